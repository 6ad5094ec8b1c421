"""watch's loop over one node (discovery/node.py): the node a command made (its roots checked, its profile
dirs) is the one the loop and the device plugin over it watch; its profiles are loaded once, its devices found
again on every rescan (`Node.rescanned`), a hot-plug included."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from devinject.agent.watch import Watcher, WatchOptions, watched_node
from devinject.discovery import node as discovery_node
from devinject.discovery.node import Node
from devinject.kubelet.agent import DevicePluginAgent, PluginOptions
from devinject.specs.generate import GenerateOptions
from tests.unit.test_node import AUDIO_PROFILE

GPU1 = "0000:2a:00.0"


def options(root: Path, tmp_path: Path, **generate: Any) -> WatchOptions:
    return WatchOptions(generate=GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", **generate),
                        output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state"), threshold=3,
                        kernel_log="/var/log/kern.log", probe_timeout=0.5, uevents=False)


def test_the_loop_and_the_device_plugin_watch_the_node_they_are_given(host_copy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A node with a --profile-dir the options do not name: its devices are the ones served (the loop used to
    build its own Host and profiles from the options)."""
    root = host_copy("workstation")
    (root / "dev/acme-audio0").write_text("")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "acme.yaml").write_text(AUDIO_PROFILE)
    node = Node(str(root), profile_dirs=(str(profiles),), state_dir=str(tmp_path / "state"))
    w = Watcher(options(root, tmp_path), node=node)
    assert w.scanned is node and w.host is node.host
    w.rescan()
    w.check()
    w.write()
    assert "acme.example/audio" in {f.profile.kind for f in w.found}
    assert (tmp_path / "cdi" / "acme.example-audio.yaml").exists()
    agent = DevicePluginAgent(PluginOptions(watch=options(root, tmp_path / "plugin")), node=node)
    assert agent.watcher.scanned is node
    agent.watcher.rescan()
    assert "acme.example/audio" in {f.profile.kind for f in agent.watcher.found}
    # without a node: the one the options describe, with their roots, state dir and kernel log
    made = watched_node(options(root, tmp_path, profile_dirs=(str(profiles),), target_root="/target"))
    assert (made.root, made.target_root, made.profile_dirs, made.state_dir, made.kernel_log) == (
        str(root), "/target", (str(profiles),), str(tmp_path / "state"), "/var/log/kern.log")


def test_a_rescan_finds_a_hot_plug_with_the_profiles_loaded_once(host_copy, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    loads = []
    load = discovery_node.load_profiles
    monkeypatch.setattr(discovery_node, "load_profiles", lambda *a: loads.append(a) or load(*a))
    root = host_copy("hgx-h100")
    w = Watcher(options(root, tmp_path, kinds=("nvidia.com/gpu",)))
    assert w.rescan()
    first = w.scanned
    assert len(w.found) == 8 and {f.profile.kind for f in w.found} == {"nvidia.com/gpu"}  # --kind: its own
    link = root / "sys/bus/pci/devices" / GPU1
    target = os.readlink(link)
    link.unlink()  # unplugged
    assert w.rescan()
    assert GPU1 not in {f.address for f in w.found} and len(w.found) == 7
    assert w.scanned is not first and w.scanned.profiles is first.profiles
    link.symlink_to(target)  # plugged in again
    assert w.rescan()
    assert GPU1 in {f.address for f in w.found} and len(w.found) == 8
    assert not w.rescan()  # nothing changed
    assert len(loads) == 1
