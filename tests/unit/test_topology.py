"""Topology from sysfs: the relations between devices, checked on synthetic PCIe trees and, as a golden
reviewed by hand, on the HGX H100 host (each GPU shares a switch with one NIC; four pairs per NUMA node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.discovery.topology import NODE, PHB, PIX, PXB, SELF, SYS, Place, relation
from tests.conftest import FIXTURES, HOSTS

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def place(path: str, numa: int | None = 0) -> Place:
    parts = tuple(path.split("/"))
    return Place(parts[-1], parts, numa, "")


@pytest.mark.parametrize(("a", "b", "expected"), [
    ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
     "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", PIX),  # one switch
    ("pci0000:00/0000:00:01.0/0000:05:00.0", "pci0000:00/0000:00:01.0/0000:05:00.1", PIX),  # one slot
    ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0/0000:04:00.0/0000:05:00.0",
     "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:06:00.0", PXB),  # nested switches
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:00/0000:00:02.0/0000:02:00.0", PHB),  # two root ports
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0", NODE),  # same NUMA node
    ("pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0", SELF),
])
def test_relations_follow_the_pcie_tree(a: str, b: str, expected: str) -> None:
    assert relation(place(a), place(b)) == expected
    assert relation(place(b), place(a)) == expected  # symmetric


def test_numa_nodes_decide_across_host_bridges_and_unknown_is_never_closer() -> None:
    one, other = "pci0000:00/0000:00:01.0/0000:01:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0"
    assert relation(place(one, 0), place(other, 1)) == SYS
    assert relation(place(one, None), place(other, 0)) == SYS  # the kernel does not know: not guessed NODE
    assert relation(place(one, None), place("pci0000:00/0000:00:02.0/0000:02:00.0", None)) == PHB


def test_hgx_matrix_matches_the_reviewed_golden() -> None:
    done = subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / "hgx-h100")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (FIXTURES / "golden-topo" / "hgx-h100.txt").read_text()


def test_json_for_tools() -> None:
    done = subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / "hgx-h100"), "--json"], capture_output=True,
                          text=True, timeout=60)
    data = json.loads(done.stdout)
    gpu0 = data["devices"][0]
    assert (gpu0["label"], gpu0["pci"], gpu0["numa_node"]) == ("GPU0", "0000:18:00.0", 0)
    assert data["matrix"]["GPU0"]["NIC0"] == PIX and data["matrix"]["GPU0"]["GPU4"] == SYS
    assert data["matrix"]["GPU0"]["GPU1"] == NODE


@pytest.fixture(scope="module")
def hgx():  # type: ignore[no-untyped-def]
    from devinject.discovery.discover import discover
    from devinject.discovery.host import Host
    from devinject.discovery.profiles import load_profiles
    from devinject.discovery.topology import topology

    host = Host(str(HOSTS / "hgx-h100"))
    return topology(host, discover(host, load_profiles(host)))


def test_placement_picks_the_closest_set_and_honours_must_include(hgx) -> None:  # type: ignore[no-untyped-def]
    from devinject.discovery.topology import place_devices

    gpus = [p for p, label in zip(hgx.places, hgx.labels, strict=True) if label.startswith("GPU")]
    every = list(hgx.places)
    # two GPUs: no switch holds two, so the same NUMA node (NODE), lowest addresses first
    assert place_devices(gpus, 2) == ["0000:18:00.0", "0000:2a:00.0"]
    # a GPU on socket 1 must be included: its partner comes from socket 1, not socket 0
    assert place_devices(gpus, 2, ("0000:9a:00.0",)) == ["0000:9a:00.0", "0000:ab:00.0"]
    # a GPU and a NIC: the NIC under the same switch (PIX)
    assert place_devices(every, 2, ("0000:ab:00.0",)) == ["0000:ab:00.0", "0000:ac:00.0"]
    # five GPUs cannot fit one socket: across sockets, the first socket filled first
    five = place_devices(gpus, 5)
    assert len(five) == 5 and sum(a < "0000:80" for a in five) == 4
    assert place_devices(gpus, 9) == [] and place_devices(gpus, 1, ("0000:00:00.0",)) == []


def test_placement_never_pairs_unknown_numa_nodes_as_close() -> None:
    from devinject.discovery.topology import place_devices

    a = place("pci0000:00/0000:00:01.0/0000:01:00.0", None)
    b = place("pci0000:80/0000:80:01.0/0000:81:00.0", None)
    c = place("pci0000:00/0000:00:02.0/0000:02:00.0", None)
    assert place_devices([a, b, c], 2) == ["0000:01:00.0", "0000:02:00.0"]  # one host bridge beats unknown
