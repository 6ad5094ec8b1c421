"""One reader of device names (discovery/resolve.py): every command that takes a DEVICE accepts the same names
and refuses an unknown one with the same line and exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.discovery.node import Node
from devinject.discovery.resolve import UnknownDevice, resolve, resolve_one
from devinject.nodestate import events
from tests.conftest import HOSTS

DEVINJECT = str(Path(sys.executable).parent / "devinject")
HGX = str(HOSTS / "hgx-h100")
WORKSTATION = str(HOSTS / "workstation")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DEVINJECT, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["nvidia.com/gpu=1", "1", "0000:2a:00.0", "nvidia.com/gpu=0000:2a:00.0",
                                  "nvidia.com/gpu=GPU-5b3c0a1f-7c1d-4c1b-9a55-0e1f2a3b4c01",
                                  "GPU-5b3c0a1f-7c1d-4c1b-9a55-0e1f2a3b4c01", "GPU1"])
def test_every_name_of_a_device_resolves_to_it(name: str) -> None:
    named = resolve(Node(HGX), name)
    assert "nvidia.com/gpu=0000:2a:00.0" in named.keys
    if name != "1":  # `1` is GPU 1 and NIC 1
        assert named.keys == ("nvidia.com/gpu=0000:2a:00.0",)


def test_a_topo_label_is_what_topo_prints_not_the_index() -> None:
    """On the workstation the Intel GPU comes first in the PCIe tree: topo's GPU1 is nvidia.com/gpu=0."""
    labels = json.loads(run("topo", "--root", WORKSTATION, "--json").stdout)["devices"]
    node = Node(WORKSTATION)
    for label, device in labels.items():
        (found,) = resolve(node, label).devices
        assert node.names(found)[0] == device["name"] and found.address == device["pci_address"], label
    assert labels["GPU1"]["name"] == "nvidia.com/gpu=0"


def test_an_unknown_name_is_one_error_with_the_nearest_names() -> None:
    with pytest.raises(UnknownDevice, match=r"^nvidia.com/gpu=9: no such device under .*; did you mean "):
        resolve(Node(HGX), "nvidia.com/gpu=9")
    with pytest.raises(UnknownDevice):
        resolve(Node(HGX), "GPU8")  # a label's shape, no such label
    with pytest.raises(Exception, match="names 2 devices"):
        resolve_one(Node(HGX), "1")


@pytest.mark.parametrize("command", ["doctor", "who", "events", "put-back"])
def test_every_command_that_takes_a_device_refuses_an_unknown_one_the_same_way(tmp_path: Path, command: str) -> None:
    """Was: doctor said "no device ... (devices: ...)", who printed "no process holds a device node" (exit 0),
    events "no events" (exit 0)."""
    done = run(command, "--root", HGX, "--state-dir", str(tmp_path / "state"), "nvidia.com/gpu=99")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and done.stdout == ""
    assert lines == [f"devinject: error: nvidia.com/gpu=99: no such device under {HGX}; did you mean "
                     "nvidia.com/gpu=7 or nvidia.com/gpu=6 or nvidia.com/gpu=5?"]


@pytest.mark.parametrize("command", ["doctor", "who", "put-back"])
def test_every_command_that_takes_a_device_takes_the_topo_label(tmp_path: Path, command: str) -> None:
    done = run(command, "--root", HGX, "--state-dir", str(tmp_path / "state"), "GPU3", "--runtime", "runc") \
        if command == "doctor" else run(command, "--root", HGX, "--state-dir", str(tmp_path / "state"), "GPU3")
    assert "no such device" not in done.stderr and "Traceback" not in done.stderr
    if command == "doctor":
        assert done.stdout.startswith("nvidia.com/gpu=3\n")
    if command == "put-back":
        assert done.returncode == 0 and done.stdout.startswith("nvidia.com/gpu=0000:5d:00.0: put-back requested")


def test_events_of_a_device_are_its_own_by_any_of_its_names(tmp_path: Path) -> None:
    """Was: `events nvidia.com/gpu=1` after a put-back of GPU 1 printed "no events" and `events
    nvidia.com/gpu=0` printed GPU 1's (a substring match: the key `nvidia.com/gpu=0000:2a:00.0` starts with
    `nvidia.com/gpu=0`)."""
    state = str(tmp_path / "state")
    assert run("put-back", "--root", HGX, "--state-dir", state, "nvidia.com/gpu=1").returncode == 0
    events.record(state, "unhealthy", "nvidia.com/gpu=0000:18:00.0", health="unhealthy")

    def keys(*args: str) -> set[str]:
        done = run("events", "--root", HGX, "--state-dir", state, "--json", *args)
        assert done.returncode == 0, done.stderr
        return {e["name"] for e in json.loads(done.stdout)}

    gpu1 = {"nvidia.com/gpu=0000:2a:00.0"}
    assert keys("nvidia.com/gpu=1") == keys("GPU1") == keys("0000:2a:00.0") == keys(*gpu1) == gpu1
    assert keys("nvidia.com/gpu=0") == {"nvidia.com/gpu=0000:18:00.0"}
    assert keys() == gpu1 | {"nvidia.com/gpu=0000:18:00.0"}
