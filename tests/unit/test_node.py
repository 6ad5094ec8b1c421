"""The one way in (devinject.api.Node, discovery/node.py): its roots checked once, profiles loaded and devices
discovered once, the names a device answers to, and each result record's JSON form (docs/json.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devinject.agent.watch import Watcher, WatchOptions, watched_node
from devinject.api import Event, Node
from devinject.core.errors import ConfigError
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.discovery import node as discovery_node
from devinject.discovery.node import device_names
from devinject.results import DeviceHealth, DeviceRecord, HeldNode, Holder
from devinject.specs.generate import GenerateOptions
from tests.conftest import HOSTS

HGX = str(HOSTS / "hgx-h100")
# a family the shipped profiles do not have: the workstation's HDMI audio function, its node /dev/null's numbers
AUDIO_PROFILE = """\
name: acme-audio
kind: acme.example/audio
match: {vendor: ["10de"], class: ["0403"]}
device-nodes:
  - {path: "/dev/acme-audio{index}", major: 1, minor: 3}
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devinject", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def audio(host_copy, tmp_path: Path) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """A workstation copy with /dev/acme-audio0, and a --profile-dir (outside the root) whose profile offers it."""
    root = host_copy("workstation")
    (root / "dev/acme-audio0").write_text("")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "acme.yaml").write_text(AUDIO_PROFILE)
    return root, profiles


# --- the roots, checked once ----------------------------------------------------------------------------

def test_each_root_given_is_checked_when_the_node_is_made(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError, match=f"^--root {tmp_path}/absent: no such directory$"):
        Node(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=f"^--profile-dir {tmp_path}/gone: no such directory$"):
        Node(HGX, profile_dirs=(str(tmp_path),  str(tmp_path / "gone")))
    with pytest.raises(ConfigError, match=f"^--state-dir {afile}/state: cannot be created"):
        Node(HGX, state_dir=str(afile / "state"))
    with pytest.raises(ConfigError, match="^--kernel-log /var/log/kern.log: no such file"):
        Node(HGX, kernel_log="/var/log/kern.log", kernel_log_explicit=True)
    Node(HGX, kernel_log="/var/log/kern.log")  # the default may be missing
    Node(HGX, state_dir=str(tmp_path / "not-yet"))  # may be made
    assert not (tmp_path / "not-yet").exists()
    unchecked = Node(str(tmp_path / "absent"), profile_dirs=(str(tmp_path / "gone"),), check=False)
    assert unchecked.devices() == []  # the hook's cache miss: nothing there, no profiles added


def test_the_node_keeps_its_roots(tmp_path: Path) -> None:
    node = Node(HGX, target_root="/host", profile_dirs=(str(tmp_path),), state_dir=str(tmp_path),
                kernel_log="/var/log/kern.log")
    assert (node.root, node.target_root, node.profile_dirs, node.state_dir, node.kernel_log) == (
        HGX, "/host", (str(tmp_path),), str(tmp_path), "/var/log/kern.log")
    assert node.host.root == HGX and node.view.host is node.host
    assert Node(HGX).state_dir is None and Node(HGX).kernel_log is None and Node(HGX).target_root is None


def test_profiles_are_loaded_and_devices_discovered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"load": 0, "discover": 0}
    load, discover = discovery_node.load_profiles, discovery_node.discover

    def counted_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["load"] += 1
        return load(*args, **kwargs)

    def counted_discover(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["discover"] += 1
        return discover(*args, **kwargs)

    monkeypatch.setattr(discovery_node, "load_profiles", counted_load)
    monkeypatch.setattr(discovery_node, "discover", counted_discover)
    node = Node(HGX)
    assert node.devices() is node.devices() and node.profiles is node.profiles
    node.topology()
    node.inventory()
    node.health()
    node.specs(__import__("devinject.specs.generate", fromlist=["GenerateOptions"]).GenerateOptions(hook_path="/x"))
    assert calls == {"load": 1, "discover": 1}


def test_a_rescanned_node_reads_the_host_again_with_the_same_profiles(host_copy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`watch`'s rescan: a function unplugged is gone from the rescanned node's devices (a fresh view of the
    host), while the node it came from keeps what it found; the profiles are not loaded nor the roots checked
    again, and the node is still an api.Node with its roots."""
    root = host_copy("hgx-h100")
    node = Node(str(root), target_root="/host", state_dir=str(root / "state"))
    before = node.devices()
    link = root / "sys/bus/pci/devices/0000:2a:00.0"
    link.unlink()
    driver = root / "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0/driver"
    driver.unlink()  # GPU0 bound to another driver: the link the first scan read (and memoised) changed
    driver.symlink_to("../../../../../../bus/pci/drivers/ast")
    checks = []
    monkeypatch.setattr(discovery_node, "check_roots", lambda **kw: checks.append(kw))
    monkeypatch.setattr(discovery_node, "load_profiles", lambda *a: pytest.fail("profiles loaded again"))
    again = node.rescanned()
    assert isinstance(again, Node) and again is not node and not checks
    assert (again.root, again.target_root, again.state_dir, again.host) == (node.root, "/host", node.state_dir,
                                                                             node.host)
    assert again.profiles is node.profiles and again.view is not node.view and again.view.host is node.host
    gpus = {f.address for f in again.devices() if f.profile.kind == "nvidia.com/gpu"}
    assert len(gpus) == 6 and not gpus & {"0000:2a:00.0", "0000:18:00.0"}
    assert node.devices() is before
    assert again.find("0000:2a:00.0") == [] and len(node.find("0000:2a:00.0")) == 1


def test_profile_dirs_are_read_by_the_node(audio: tuple[Path, Path]) -> None:
    root, profiles = audio
    assert "acme.example/audio" not in {f.profile.kind for f in Node(str(root)).devices()}
    (found,) = [f for f in Node(str(root), profile_dirs=(str(profiles),)).devices()
                if f.profile.kind == "acme.example/audio"]
    assert [n.path for n in found.nodes] == ["/dev/acme-audio0"]


# --- names -----------------------------------------------------------------------------------------------

def test_device_names_by_strategy() -> None:
    node = Node(HGX)
    gpu = next(f for f in node.devices() if f.profile.kind == "nvidia.com/gpu")
    assert device_names(gpu, ("pci",)) == [gpu.address]
    assert device_names(gpu, ("index", "pci", "index")) == [str(gpu.index), gpu.address]
    assert device_names(gpu, ("uuid",)) == [gpu.uuid or gpu.address]
    assert device_names(gpu, ()) == ([str(gpu.index), gpu.uuid] if gpu.uuid else [str(gpu.index), gpu.address])
    nouuid = next(f for f in node.devices() if not f.uuid)
    assert device_names(nouuid, ()) == [str(nouuid.index), nouuid.address]
    assert device_names(nouuid, ("uuid",)) == [nouuid.address]
    assert node.names(nouuid) == [f"{nouuid.profile.kind}={nouuid.index}", f"{nouuid.profile.kind}={nouuid.address}"]
    assert node.names(nouuid, ("pci",)) == [f"{nouuid.profile.kind}={nouuid.address}"]


def test_find_and_name_of() -> None:
    node = Node(HGX)
    gpu = next(f for f in node.devices() if f.profile.kind == "nvidia.com/gpu" and f.index == 1)
    for name in ("nvidia.com/gpu=1", f"nvidia.com/gpu={gpu.address}", gpu.address, *(
            [gpu.uuid, f"nvidia.com/gpu={gpu.uuid}"] if gpu.uuid else [])):
        assert node.find(name) == [gpu], name
    assert {f.profile.kind for f in node.find("1")} == {"nvidia.com/gpu", "nvidia.com/rdma"}  # a bare index
    assert node.find("nvidia.com/gpu=99") == [] and node.find("0000:ff:00.0") == []
    assert node.name_of("nvidia.com/gpu", gpu.address) == "nvidia.com/gpu=1"
    assert node.name_of("nvidia.com/rdma", gpu.address) == f"nvidia.com/rdma={gpu.address}"  # not discovered


# --- the JSON forms ------------------------------------------------------------------------------------

def test_record_json_forms() -> None:
    holder = Holder(7, "ctr", "python3", "c 1:3", "active")
    assert holder.to_json() == {"pid": 7, "container": "ctr", "command": "python3", "node": "c 1:3",
                                "state": "active"}
    assert Holder(None, None).to_json() == {"pid": None, "container": None, "command": None, "node": None,
                                            "state": None}
    health = DeviceHealth("a.com/b=0", "a.com/b", "0000:01:00.0", "degraded", ("slow",))
    assert health.to_json() == {"name": "a.com/b=0", "kind": "a.com/b", "pci_address": "0000:01:00.0",
                                "health": "degraded", "reasons": ["slow"]}
    assert not health.healthy and DeviceHealth("n", "k", "p", "healthy").healthy
    held = HeldNode("a.com/b=0", "a.com/b", "0000:01:00.0", holder)
    assert held.to_json() == {"name": "a.com/b=0", "kind": "a.com/b", "pci_address": "0000:01:00.0",
                              **holder.to_json()}
    record = DeviceRecord(("a.com/b=0", "a.com/b=u"), "a.com/b", "0000:01:00.0", ("0000:01:00.0",), "Acme", "X1",
                          "1234:5678", "u", None, "acme", "exclusive", "unhealthy", ("gone",), (holder,),
                          "allocated", (("/dev/b0", 240, 0),), (("c.com/d=0", "PIX"),))
    assert record.name == "a.com/b=0"
    assert record.to_json() == {
        "name": "a.com/b=0", "names": ["a.com/b=0", "a.com/b=u"], "kind": "a.com/b", "pci_address": "0000:01:00.0",
        "functions": ["0000:01:00.0"], "vendor": "Acme", "model": "X1", "pci_id": "1234:5678", "uuid": "u",
        "numa_node": None, "driver": "acme", "sharing": "exclusive", "health": "unhealthy", "reasons": ["gone"],
        "holders": [holder.to_json()], "allocation": "allocated",
        "nodes": [{"path": "/dev/b0", "major": 240, "minor": 0}],
        "paired_with": [{"name": "c.com/d=0", "relation": "PIX"}], "replicas": None, "memory_bytes": None,
        "compute_capability": None}


def test_event_json_form() -> None:
    event = Event.of("a.com/b=0000:01:00.0", {"time": 12.5, "event": "put-back", "device": "a.com/b=0000:01:00.0",
                                               "status": "healthy", "by": "admin"})
    assert event.to_json() == {"name": "a.com/b=0000:01:00.0", "kind": "a.com/b", "pci_address": "0000:01:00.0",
                               "time": 12.5, "event": "put-back", "reasons": [], "by": "admin",
                               "health": "healthy"}
    assert Event.of("k=p", {"time": 1, "event": "taken-out", "reasons": ["Xid 79"]}).reasons == ("Xid 79",)


def test_node_answers_events_specs_and_the_list(tmp_path: Path) -> None:
    from devinject.nodestate import events
    from devinject.specs.generate import GenerateOptions

    state = tmp_path / "state"
    events.record(str(state), "taken-out", "nvidia.com/gpu=0000:2a:00.0", reasons=["Xid 79"])
    events.record(str(state), "added", "nvidia.com/gpu=0000:18:00.0")
    node = Node(HGX, state_dir=str(state))
    assert [(e.name, e.event) for e in node.events()] == [("nvidia.com/gpu=0000:18:00.0", "added"),
                                                          ("nvidia.com/gpu=0000:2a:00.0", "taken-out")]
    assert [e.event for e in node.events("0000:2a:00.0")] == ["taken-out"]
    specs = node.specs(GenerateOptions(root="/nonexistent", hook_path="/x", kinds=("nvidia.com/gpu",)))
    assert [s.kind for s in specs] == ["nvidia.com/gpu"]  # the node's root, not the options'
    rows = {r.name: r for r in node.inventory()}
    assert rows["nvidia.com/gpu=0"].numa_node == 0 and rows["nvidia.com/gpu=0"].allocation == "free"
    assert rows["nvidia.com/gpu=0"].paired_with == (("nvidia.com/rdma=0", "PIX"),)
    assert rows["nvidia.com/rdma=0"].paired_with == (("nvidia.com/gpu=0", "PIX"),)
    health = {h.name: h for h in node.health()}
    assert health["nvidia.com/gpu=0"].health == "healthy" and health["nvidia.com/gpu=0"].pci_address == "0000:18:00.0"


# --- the commands that dropped --profile-dir ------------------------------------------------------------

def test_who_reads_the_profile_dirs(audio: tuple[Path, Path], tmp_path: Path) -> None:
    root, profiles = audio
    with open("/dev/null"):  # /dev/acme-audio0 has its numbers
        done = cli("who", "acme.example/audio=0", "--root", str(root), "--state-dir", str(tmp_path / "state"),
                   "--profile-dir", str(profiles), "--json")
    assert done.returncode == 0, done.stderr
    assert os.getpid() in {row["pid"] for row in __import__("json").loads(done.stdout)
                           if row["name"] == "acme.example/audio=0" and row["node"] == "c 1:3"}


def test_create_dev_char_links_reads_the_profile_dirs(audio: tuple[Path, Path]) -> None:
    root, profiles = audio
    (root / "dev/char").mkdir(exist_ok=True)
    if (root / "dev/char/1:3").is_symlink():
        (root / "dev/char/1:3").unlink()
    assert "1:3" not in cli("create-dev-char-links", "--root", str(root), "--dry-run").stdout
    done = cli("create-dev-char-links", "--root", str(root), "--profile-dir", str(profiles))
    assert done.returncode == 0, done.stderr
    assert os.readlink(root / "dev/char/1:3") == "../acme-audio0"


# --- what the commands ask, in-process (the CLI tests above run another process, so mutation testing does
# not see them) ----------------------------------------------------------------------------------------------

def test_a_host_given_is_the_one_the_node_reads() -> None:
    from devinject.discovery.host import Host

    host = Host(HGX)
    node = Node(HGX, host=host)
    assert node.host is host and node.view.host is host
    assert Node(HGX).host is not host and Node(HGX).host.root == HGX


def test_specs_are_the_nodes_own_profile_dirs_and_target_root(audio: tuple[Path, Path]) -> None:
    """`specs(options)` writes for the node: its --profile-dir's kinds and its --target-root, whatever the
    options say."""
    from devinject.specs.generate import GenerateOptions

    root, profiles = audio
    node = Node(str(root), target_root="/target", profile_dirs=(str(profiles),))
    options = GenerateOptions(root="/nonexistent", hook_path="/x", kinds=("acme.example/audio",), target_root="/o")
    (spec,) = node.specs(options)
    assert spec.kind == "acme.example/audio"
    assert {(n.path, n.host_path) for d in spec.devices for n in d.edits.device_nodes} == {(
        "/dev/acme-audio0", "/target/dev/acme-audio0")}


def test_holders_and_dev_char_links_of_the_node(audio: tuple[Path, Path], tmp_path: Path) -> None:
    root, profiles = audio
    node = Node(str(root), profile_dirs=(str(profiles),), state_dir=str(tmp_path / "state"))
    with open("/dev/null"):  # /dev/acme-audio0 has its numbers
        mine = [row for row in node.holders("acme.example/audio=0") if row.holder.pid == os.getpid()]
        everyone = {(row.name, row.holder.pid) for row in node.holders()}
    assert [(row.name, row.kind, row.holder.node) for row in mine] == [("acme.example/audio=0", "acme.example/audio",
                                                                      "c 1:3")]
    assert ("acme.example/audio=0", os.getpid()) in everyone
    assert node.holders("nvidia.com/gpu=0") == []  # the fixture's nodes are files: nobody holds them
    (root / "dev/char").mkdir(exist_ok=True)
    if (root / "dev/char/1:3").is_symlink():
        (root / "dev/char/1:3").unlink()
    links = dict(node.dev_char_links())
    assert links[str(root / "dev/char/1:3")] == "../acme-audio0"
    assert str(root / "dev/char/1:3") not in dict(Node(str(root)).dev_char_links())


def test_health_takes_the_probe_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from devinject import inventory
    from devinject.agent.health import PROBE_TIMEOUT

    asked = []
    monkeypatch.setattr(inventory, "device_health", lambda node, timeout: asked.append((node, timeout)) or [])
    node = Node(HGX)
    assert node.health(timeout=0.25) == [] and node.health() == []
    assert asked == [(node, 0.25), (node, PROBE_TIMEOUT)]


def test_an_events_details_are_the_rest_of_the_entry_in_name_order() -> None:
    event = Event.of("a.com/b=0000:01:00.0", {"time": 3, "event": "cleared", "device": "a.com/b=0000:01:00.0",
                                               "reasons": ["x"], "status": "healthy", "by": "admin",
                                               "functions": ["0000:01:00.0"]})
    assert event.details == (("by", "admin"), ("functions", ["0000:01:00.0"]), ("health", "healthy"))
    assert (event.time, event.event, event.reasons) == (3.0, "cleared", ("x",))
    assert isinstance(event.time, float)


# --- watch and the device plugin over the node (agent/watch.py, deviceplugin/agent.py) -----------------------
# The node a command made (its roots checked, its profile dirs) is the one the loop and the device plugin over
# it watch; its profiles are loaded once, its devices found again on every rescan (`Node.rescanned`).

GPU1 = "0000:2a:00.0"


def options(root: Path, tmp_path: Path, **generate: Any) -> WatchOptions:
    return WatchOptions(generate=GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", **generate),
                        output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state"), threshold=3,
                        kernel_log="/var/log/kern.log", probe_timeout=0.5, uevents=False)


def test_the_loop_and_the_device_plugin_watch_the_node_they_are_given(audio: tuple[Path, Path], tmp_path: Path) -> None:
    """A node with a --profile-dir the options do not name: its devices are the ones served (the loop used to
    build its own Host and profiles from the options)."""
    root, profiles = audio
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


def test_watch_reads_the_profile_dirs_it_is_given(audio: tuple[Path, Path], tmp_path: Path) -> None:
    """`devinject watch --profile-dir` (and device-plugin's, the same options): the node the CLI hands the loop
    has them, as generate's has (watch had no --profile-dir, so it could not serve what generate wrote)."""
    import signal
    import subprocess
    import sys
    import time

    root, profiles = audio
    spec = tmp_path / "cdi" / "acme.example-audio.yaml"
    agent = subprocess.Popen([sys.executable, "-m", "devinject", "watch", "--root", str(root), "--profile-dir",
                              str(profiles), "--output-dir", str(tmp_path / "cdi"), "--state-dir",
                              str(tmp_path / "state"), "--hook-path", "/usr/bin/devinject", "--no-uevents"],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not spec.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=30)
    assert spec.exists(), stderr
    assert "/dev/acme-audio0" in spec.read_text()


def test_the_default_root_and_one_view_of_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node is `/` unless told; its devices, specs and topology read the host's shared files (/proc/devices)
    once, through the node's one view."""
    from devinject.discovery.host import Host

    assert Node(check=False).root == "/" and Node(check=False).host.root == "/"
    reads = []
    read_text = Host.read_text
    monkeypatch.setattr(Host, "read_text", lambda self, path: reads.append(path) or read_text(self, path))
    node = Node(str(HOSTS / "mi300x"))  # its discovery reads /proc/devices (the kfd partitions' major)
    node.devices()
    node.specs(GenerateOptions(hook_path="/x"))
    assert reads.count("/proc/devices") == 1
