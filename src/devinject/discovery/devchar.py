"""/dev/char/MAJ:MIN links for device nodes udev did not create (NVIDIA's, for one).

systemd resolves a unit's `DeviceAllow=` through these links when it re-applies device policy on
`daemon-reload`; without them a hook-granted rule can be dropped.
"""

from __future__ import annotations

import os
import posixpath

from devinject.discovery.discover import HostView, discover, shared_nodes
from devinject.discovery.host import Host
from devinject.discovery.profiles import load_profiles


def missing_links(root: str) -> list[tuple[str, str]]:
    """(link path on this machine, relative target) for every discovered node without a /dev/char link."""
    host = Host(root)
    profiles = load_profiles(host)
    view = HostView(host)
    found = discover(host, profiles, view=view)
    nodes = [n for f in found for n in f.nodes]
    for profile in {f.profile.name: f.profile for f in found}.values():
        nodes += shared_nodes(view, profile)
    out = []
    for node in dict.fromkeys(nodes):
        if node.major is None or node.minor is None or not host.exists(node.path):
            continue
        link = f"/dev/char/{node.major}:{node.minor}"
        if not os.path.lexists(host.real(link)):
            out.append((host.real(link), posixpath.relpath(node.path, "/dev/char")))
    return sorted(set(out))
