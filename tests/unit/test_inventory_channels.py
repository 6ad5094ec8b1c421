"""IMEX channels (profile nvidia-imex-channels: char nodes, no PCI function) in what `list`, `health` and `who`
show, through the node (devinject.api.Node): one row per channel with its node and no PCI address, healthy
while its node is there, held when a process has it open or the ledger booked it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.api import Node
from devinject.nodestate.ledger import Claim, Ledger
from tests.conftest import HOSTS

DGX = HOSTS / "dgx-a100-mig"  # channel0 and channel1, region nvidia-caps-imex-channels 233 (build_hosts.py)
KIND = "nvidia.com/imex-channel"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devinject", *args], capture_output=True, text=True, timeout=60)


def held_channel(host_copy) -> Path:  # type: ignore[no-untyped-def]
    """A DGX copy whose IMEX region is major 1 with a channel3: c 1:3, /dev/null's numbers, so a process
    holding /dev/null open holds channel 3."""
    root: Path = host_copy("dgx-a100-mig")
    devices = root / "proc/devices"
    devices.write_text(devices.read_text().replace("233 nvidia-caps-imex-channels\n",
                                                   "1 nvidia-caps-imex-channels\n"))
    (root / "dev/nvidia-caps-imex-channels/channel3").write_text("")
    return root


def channel_watcher(root: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """`watch` over the channels of `root`, its state in tmp_path/state, once rescanned."""
    from devinject.agent.watch import Watcher, WatchOptions
    from devinject.specs.generate import GenerateOptions

    gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=(KIND,))
    watcher = Watcher(WatchOptions(generate=gen, output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state"),
                                   threshold=1, uevents=False))
    watcher.rescan()
    return watcher


def test_list_shows_each_channel_with_its_node_and_no_pci_address() -> None:
    rows = {r.name: r for r in Node(str(DGX)).inventory()}
    assert [n for n in rows if n.startswith(KIND)] == [f"{KIND}=0", f"{KIND}=1"]
    one = rows[f"{KIND}=1"]
    assert one.to_json() == {
        "name": f"{KIND}=1", "names": [f"{KIND}=1"], "kind": KIND, "pci_address": None, "functions": [],
        "vendor": "NVIDIA", "model": "NVIDIA imex-channel", "pci_id": None, "uuid": None, "numa_node": None,
        "driver": None, "sharing": "exclusive", "health": "healthy", "reasons": [], "holders": [],
        "allocation": "free", "nodes": [{"path": "/dev/nvidia-caps-imex-channels/channel1", "major": 233,
                                         "minor": 1}],
        "paired_with": [], "replicas": None, "memory_bytes": None, "compute_capability": None}
    assert rows["nvidia.com/gpu=0"].pci_address == "0000:07:00.0"  # the GPUs as before


def test_list_text_and_json_show_the_channels() -> None:
    done = cli("list", "--root", str(DGX))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith(f"{KIND}=0 "))
    assert line.split() == [f"{KIND}=0", "-", "NVIDIA", "imex-channel", "-", "-", "-", "-", "healthy", "exclusive",
                            "-", "-", "/dev/nvidia-caps-imex-channels/channel0"]
    done = cli("list", "--root", str(DGX), "--json")
    assert done.returncode == 0, done.stderr
    assert [(r["name"], r["pci_address"]) for r in json.loads(done.stdout) if r["kind"] == KIND] == [
        (f"{KIND}=0", None), (f"{KIND}=1", None)]


def test_a_channel_whose_node_is_gone_or_another_is_unhealthy(host_copy) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("dgx-a100-mig")
    node = Node(str(root))
    assert [(h.name, h.pci_address, h.health) for h in node.health() if h.kind == KIND] == [
        (f"{KIND}=0", None, "healthy"), (f"{KIND}=1", None, "healthy")]
    node.channels()  # discovered with both nodes there
    (root / "dev/nvidia-caps-imex-channels/channel1").unlink()
    health = {h.name: h for h in node.health()}
    assert health[f"{KIND}=0"].healthy
    assert (health[f"{KIND}=1"].health, health[f"{KIND}=1"].reasons) == (
        "unhealthy", ("/dev/nvidia-caps-imex-channels/channel1: no such node",))
    assert {r.name: r.health for r in node.inventory()}[f"{KIND}=1"] == "unhealthy"
    os.mknod(root / "dev/nvidia-caps-imex-channels/channel1", 0o600 | 0o020000, os.makedev(1, 3))
    (verdict,) = [h for h in node.health() if h.name == f"{KIND}=1"]
    assert verdict.reasons == ("/dev/nvidia-caps-imex-channels/channel1: is c 1:3, not c 233:1",)
    done = cli("health", "--root", str(root))
    assert done.returncode == 1
    assert f"{KIND}=1" in done.stdout and "unhealthy" in done.stdout and "is c 1:3, not c 233:1" in done.stdout


def test_who_and_list_name_the_holders_of_a_channel(host_copy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root = held_channel(host_copy)
    state = tmp_path / "state"
    state.mkdir()
    Ledger(str(state)).book("ctr-imex", os.getpid(), (Claim(f"{KIND}=3", ("c 1:3",)),), {KIND: "exclusive"})
    node = Node(str(root), state_dir=str(state))
    assert [c.key for c in node.find_channels(f"{KIND}=3")] == [f"{KIND}=3"] == [c.key for c in node.find_channels("3")]
    with open("/dev/null"):
        mine = [r for r in node.holders(f"{KIND}=3") if r.holder.pid == os.getpid()]
        everyone = {(r.name, r.pci_address, r.holder.pid) for r in node.holders()}
        done = cli("who", f"{KIND}=3", "--root", str(root), "--state-dir", str(state), "--json")
    assert [(r.name, r.kind, r.pci_address, r.holder.node, r.holder.container) for r in mine] == [
        (f"{KIND}=3", KIND, None, "c 1:3", "ctr-imex")]
    assert (f"{KIND}=3", None, os.getpid()) in everyone
    assert done.returncode == 0, done.stderr
    assert (f"{KIND}=3", None, "c 1:3", os.getpid()) in {
        (r["name"], r["pci_address"], r["node"], r["pid"]) for r in json.loads(done.stdout)}
    assert node.holders(f"{KIND}=0") == []  # a fixture file: nobody holds it
    row = {r.name: r for r in node.inventory()}[f"{KIND}=3"]
    assert (row.allocation, [h.container for h in row.holders]) == ("allocated", ["ctr-imex"])


def test_a_channels_events_have_no_pci_address(host_copy, tmp_path: Path,  # type: ignore[no-untyped-def]
                                               caplog: pytest.LogCaptureFixture) -> None:
    """What watch records when a channel's node goes (its key is its CDI name, `kind=N`): `events` shows it
    with pci_address null, as docs/json.md's schema says, and a GPU's event with its address."""
    from jsonschema import Draft202012Validator

    from tests.unit.test_json_schemas import schemas

    root = host_copy("dgx-a100-mig")
    state = tmp_path / "state"
    watcher = channel_watcher(root, tmp_path)
    (root / "dev/nvidia-caps-imex-channels/channel1").unlink()
    with caplog.at_level(logging.INFO, logger="devinject.agent.watch"):
        assert watcher.check()  # taken out at once: a node that is gone is a fact
    assert watcher.unhealthy() == {f"{KIND}=1"}
    assert (f"taking out {KIND}=1: /dev/nvidia-caps-imex-channels/channel1: no such node (at once: the kernel's "
            "own statement)") in caplog.messages  # by its name, with no PCI address
    from devinject.nodestate import events

    events.record(str(state), "added", "nvidia.com/gpu=0000:07:00.0")
    rows = [e.to_json() for e in Node(str(root), state_dir=str(state)).events()]
    assert [(r["name"], r["event"], r["pci_address"]) for r in rows] == [
        ("nvidia.com/gpu=0000:07:00.0", "added", "0000:07:00.0"),
        (f"{KIND}=1", "unhealthy", None), (f"{KIND}=1", "taken-out", None)]
    done = cli("events", "--state-dir", str(state), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == rows
    assert Draft202012Validator(schemas()["events"]).is_valid(rows)


def test_create_dev_char_links_covers_the_channels(host_copy) -> None:  # type: ignore[no-untyped-def]
    """No sysfs class device, so udev makes no /dev/char link for a channel: systemd's DeviceAllow= would lose
    its rule on daemon-reload."""
    root = host_copy("dgx-a100-mig")
    links = dict(Node(str(root)).dev_char_links())
    assert links[str(root / "dev/char/233:1")] == "../nvidia-caps-imex-channels/channel1"
    done = cli("create-dev-char-links", "--root", str(root), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"{root}/dev/char/233:0 -> ../nvidia-caps-imex-channels/channel0" in done.stdout.splitlines()


def test_put_back_takes_a_channel(host_copy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`devinject put-back nvidia.com/imex-channel=1` (a name `list` shows) is a request the agent takes: it
    said 'no such device'. A channel has no AER totals to accept."""
    from devinject.nodestate import events

    root = host_copy("dgx-a100-mig")
    state = tmp_path / "state"
    watcher = channel_watcher(root, tmp_path)
    node = root / "dev/nvidia-caps-imex-channels/channel1"
    node.unlink()
    watcher.check()
    assert watcher.unhealthy() == {f"{KIND}=1"}
    node.write_text("")
    done = cli("put-back", f"{KIND}=1", "--root", str(root), "--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"{KIND}=1: put-back requested; the agent puts it back after --threshold passing "
                           "checks\n")
    watcher.check()
    assert watcher.unhealthy() == frozenset()
    assert [e["event"] for e in events.device_history(str(state), f"{KIND}=1")[f"{KIND}=1"]][-4:] == [
        "put-back-requested", "cleared", "healthy", "put-back"]


def test_only_the_driver_s_own_node_names_are_channels(host_copy) -> None:  # type: ignore[no-untyped-def]
    """`channel01` (a leading zero) and `channel²` (a digit that is not ASCII) beside channel0 and channel1:
    the first made channel 1 twice (`generate`: device '1' defined twice), the second a traceback in list."""
    root: Path = host_copy("dgx-a100-mig")
    for stray in ("channel01", "channel\u00b2", "channel", "channel-2"):
        (root / "dev/nvidia-caps-imex-channels" / stray).write_text("")
    node = Node(str(root))
    assert [r.name for r in node.inventory() if r.kind == KIND] == [f"{KIND}=0", f"{KIND}=1"]
    done = cli("generate", "--root", str(root), "--output", "-", "--kind", KIND)
    assert done.returncode == 0, done.stderr


def test_a_bare_number_naming_a_gpu_and_a_channel_asks_for_the_key(tmp_path: Path) -> None:
    """`put-back 1` on the DGX names GPU 1 and channel 1: refused, and the line says how to name a channel
    (it said kind=PCI address only, which no channel has)."""
    done = cli("put-back", "1", "--root", str(DGX), "--state-dir", str(tmp_path / "state"))
    assert done.returncode != 0
    assert done.stderr.strip().endswith(f"1: names 2 devices (nvidia.com/gpu=0000:87:00.0, {KIND}=1); give one's key "
                                        "(kind=PCI address, a channel's kind=N)"), done.stderr
