"""Topology from sysfs: the relations between devices, checked on synthetic PCIe trees and, as a golden
reviewed by hand, on the HGX H100 host (each GPU shares a switch with one NIC; four pairs per NUMA node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.discovery.topology import NODE, PHB, PIX, PXB, SELF, SYS, Place, relation
from tests.conftest import FIXTURES, HOSTS, TOPOLOGY_HOSTS

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


def _golden(name: str, text: str, update: bool) -> str:
    """The reviewed golden topo output `name` (rewritten from `text` with --update-golden: review the diff)."""
    path = FIXTURES / "golden-topo" / f"{name}.txt"
    if update:
        path.write_text(text)
    return path.read_text()


def test_hgx_matrix_matches_the_reviewed_golden(update_golden: bool) -> None:
    done = subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / "hgx-h100")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _golden("hgx-h100", done.stdout, update_golden)


@pytest.mark.parametrize("name", ["hgx-h100", "workstation"])
def test_the_text_is_rendered_in_process_as_the_command_prints_it(name: str) -> None:
    """Topology.render itself (the golden tests run `devinject topo` in another process, which mutation testing
    does not see): the HGX golden, and the mixed workstation's matrix, devices, pairs and legend."""
    from devinject.discovery.node import Node

    text = Node(str(HOSTS / name)).topology().render()
    done = subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / name)], capture_output=True, text=True,
                          timeout=60, check=True)
    assert text == done.stdout
    if name == "hgx-h100":
        assert text == (FIXTURES / "golden-topo" / "hgx-h100.txt").read_text()


def test_each_matrix_label_is_tied_to_its_cdi_name_and_pci_address() -> None:
    """A mixed host (an Intel and an NVIDIA GPU, both a GPU0 of their own kind): the text says which is which,
    under the matrix, as --json's `devices` does."""
    done = subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / "workstation")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    block = done.stdout.split("\n\nDevices:\n", 1)[1].split("\n\n", 1)[0]
    data = json.loads(subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / "workstation"), "--json"],
                                     capture_output=True, text=True, timeout=60, check=True).stdout)
    assert [line.split() for line in block.splitlines()] == [
        [label, device["name"], device["pci_address"]] for label, device in data["devices"].items()]
    assert block.splitlines()[:2] == ["  GPU0   intel.com/gpu=0      0000:00:02.0",
                                      "  GPU1   nvidia.com/gpu=0     0000:01:00.0"]


def test_json_for_tools() -> None:
    done = subprocess.run([DEVINJECT, "topo", "--root", str(HOSTS / "hgx-h100"), "--json"], capture_output=True,
                          text=True, timeout=60)
    data = json.loads(done.stdout)
    assert next(iter(data["devices"])) == "GPU0"
    gpu0 = data["devices"]["GPU0"]
    assert (gpu0["name"], gpu0["pci_address"], gpu0["numa_node"]) == ("nvidia.com/gpu=0", "0000:18:00.0", 0)
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


# --- hosts described as data (tests/fixtures/topologies), goldens reviewed by hand ------------------------



def topo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DEVINJECT, "topo", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", TOPOLOGY_HOSTS)
def test_topology_hosts_match_their_reviewed_goldens(topology_hosts, name: str, update_golden: bool) -> None:  # type: ignore[no-untyped-def]
    from devinject.discovery.node import Node

    done = topo("--root", str(topology_hosts / name))
    assert done.returncode == 0, done.stderr
    assert done.stdout == _golden(name, done.stdout, update_golden)
    assert Node(str(topology_hosts / name)).topology().render() == done.stdout  # in-process: what mutants change


def test_pairing_balances_nics_and_refuses_the_slow_path(topology_hosts) -> None:  # type: ignore[no-untyped-def]
    from devinject.discovery.discover import discover
    from devinject.discovery.host import Host
    from devinject.discovery.profiles import load_profiles
    from devinject.discovery.topology import topology

    def pairs(name: str) -> dict[str, tuple[str, str]]:
        host = Host(str(topology_hosts / name))
        result = topology(host, discover(host, load_profiles(host)))
        return {result.labels[p.gpu]: (result.labels[p.nic], p.relation) for p in result.pairs()}

    # two GPUs per switch share its one NIC; never a NIC of another switch while the own one is there
    assert pairs("hgx-h100-4sw") == {f"GPU{g}": (f"NIC{g // 2}", PIX) for g in range(8)}
    assert pairs("root-ports") == {"GPU0": ("NIC0", PHB), "GPU1": ("NIC0", PHB)}  # GPU2: only SYS, no pair
    assert pairs("numa-unknown") == {"GPU0": ("NIC0", PHB)}  # unknown NUMA across host bridges is not close
    assert pairs("multi-level-switch") == {"GPU0": ("NIC0", PXB), "GPU1": ("NIC0", PXB), "GPU2": ("NIC0", PIX)}


def test_two_nics_on_a_switch_go_one_to_each_gpu() -> None:
    from devinject.discovery.topology import Topology, pair_gpus_with_nics

    switch = "pci0000:00/0000:00:01.0/0000:01:00.0"
    places = tuple(place(f"{switch}/0000:02:0{i}.0/0000:0{3 + i}:00.0") for i in range(4))
    topo_ = Topology(("GPU0", "GPU1", "NIC0", "NIC1"), (None,) * 4, places)  # type: ignore[arg-type]
    assert [(p.gpu, p.nic) for p in pair_gpus_with_nics(topo_, [0, 1], [2, 3])] == [(0, 2), (1, 3)]


def test_dot_is_valid_graphviz_and_svg_renders(topology_hosts, tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = topo("--root", str(topology_hosts / "hgx-h100-4sw"), "--format", "dot")
    assert done.returncode == 0, done.stderr
    canon = subprocess.run(["dot", "-Tcanon"], input=done.stdout, capture_output=True, text=True, timeout=60)
    assert canon.returncode == 0, canon.stderr  # Graphviz's own parser accepts it
    assert canon.stdout.count("subgraph cluster_numa") == 2
    assert canon.stdout.count("shape=house") == 4  # the four host bridges
    assert canon.stdout.count("style=dashed") == 8  # one pair edge per GPU
    svg = tmp_path / "tree.svg"
    done = topo("--root", str(topology_hosts / "hgx-h100-4sw"), "--format", "svg", "-o", str(svg))
    assert done.returncode == 0, done.stderr
    text = svg.read_text()
    assert text.startswith("<?xml") and "GPU7" in text and "NUMA node 1" in text


def test_dot_keeps_unknown_numa_outside_clusters(topology_hosts) -> None:  # type: ignore[no-untyped-def]
    done = topo("--root", str(topology_hosts / "numa-unknown"), "--format", "dot")
    assert "cluster_numa" not in done.stdout and '"pci0000:40" [shape=house' in done.stdout


def test_svg_without_graphviz_is_a_clear_error(topology_hosts, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from click.testing import CliRunner

    from devinject import cli

    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)  # no `dot` on this host
    root = str(topology_hosts / "root-ports")
    result = CliRunner().invoke(cli.cli, ["topo", "--root", root, "--format", "svg"])
    assert result.exit_code == 1
    assert "Graphviz's `dot` is not installed" in result.output


def test_dot_tree_in_process(topology_hosts) -> None:  # type: ignore[no-untyped-def]
    """The DOT text itself: one cluster per known NUMA node with its host bridges, each PCIe hop an edge,
    each device a box with its CDI name, each pair a dashed edge with its relation."""
    from devinject.discovery.discover import discover
    from devinject.discovery.host import Host
    from devinject.discovery.profiles import load_profiles
    from devinject.discovery.topology import render_dot, topology

    host = Host(str(topology_hosts / "multi-level-switch"))
    dot = render_dot(topology(host, discover(host, load_profiles(host))))
    assert dot.startswith("digraph topology {\n") and dot.endswith("}\n")
    assert 'subgraph cluster_numa0 {\n    label="NUMA node 0\\nCPUs 0-15";' in dot
    assert '"pci0000:00" [shape=house, label="host bridge 0000:00"];' in dot
    for parent, child in (("pci0000:00", "0000:00:01.0"), ("0000:02:00.0", "0000:03:00.0"),
                          ("0000:04:01.0", "0000:06:00.0"), ("0000:02:01.0", "0000:07:00.0")):
        assert f'"{parent}" -> "{child}";' in dot
    assert '"0000:05:00.0" [shape=box, style=filled, fillcolor=palegreen, label="GPU0\\nnvidia.com/gpu=0\\n' \
           '0000:05:00.0"];' in dot
    assert 'fillcolor=lightblue, label="NIC0\\nnvidia.com/rdma=0' in dot
    pairs = [line for line in dot.splitlines() if "style=dashed" in line]
    assert pairs == [
        '  "0000:05:00.0" -> "0000:07:00.0" [style=dashed, color=darkorange, constraint=false, label="PXB"];',
        '  "0000:06:00.0" -> "0000:07:00.0" [style=dashed, color=darkorange, constraint=false, label="PXB"];',
        '  "0000:08:00.0" -> "0000:07:00.0" [style=dashed, color=darkorange, constraint=false, label="PIX"];']
    assert dot.count('\n    "0000:00:01.0";\n') == 1  # a bridge is listed in its cluster once
