"""/dev/char/MAJ:MIN links for device nodes udev did not create (NVIDIA's, for one).

systemd resolves a unit's `DeviceAllow=` through these links when it re-applies device policy on
`daemon-reload`; without them a hook-granted rule can be dropped.
"""

from __future__ import annotations

import os
import posixpath

from devinject.discovery.discover import shared_nodes
from devinject.discovery.node import Node


def missing_links(node: Node) -> list[tuple[str, str]]:
    """(link path on this machine, relative target) for every discovered node without a /dev/char link: the
    devices of the node's profiles (--profile-dir's too), the nodes their kinds share, and the channels (IMEX
    channels have no sysfs class device, so udev makes no link for them)."""
    host = node.host
    found = node.devices()
    nodes = [n for f in found for n in f.nodes] + [c.node for c in node.channels()]
    for profile in {f.profile.name: f.profile for f in found}.values():
        nodes += shared_nodes(node.view, profile)
    out = []
    for device_node in dict.fromkeys(nodes):
        if device_node.major is None or device_node.minor is None or not host.exists(device_node.path):
            continue
        link = f"/dev/char/{device_node.major}:{device_node.minor}"
        if not os.path.lexists(host.real(link)):
            out.append((host.real(link), posixpath.relpath(device_node.path, "/dev/char")))
    return sorted(set(out))
