"""A node that shows no devices says why, in one line: a wrong root, no known family, drivers unbound, nodes
missing; a kind asked for and not there is an error (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from devinject.discovery.node import Node
from tests.conftest import HOSTS


def _unbind_gpus(root: Path) -> int:
    """Drop the `driver` link of every function bound to nvidia; the number unbound."""
    count = 0
    for link in (root / "sys/bus/pci/devices").iterdir():
        driver = link.resolve() / "driver"
        if driver.is_symlink() and Path(driver.readlink()).name == "nvidia":
            driver.unlink()
            count += 1
    return count


def _run(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(cli, list(args))
    return done.exit_code, done.output


def test_a_root_without_a_pci_bus_is_named():
    why = Node(str(HOSTS)).why_no_devices()
    assert "sys/bus/pci/devices does not exist" in why and "not a host's root" in why


def test_no_known_family_counts_the_functions():
    why = Node(str(HOSTS / "empty-vm")).why_no_devices()
    assert why.startswith("no devices: 3 PCI functions under ") and "none of a known device family" in why


def test_unbound_gpus_point_at_health_and_doctor(host_copy):
    root = host_copy("hgx-h100")
    assert _unbind_gpus(root) == 8
    why = Node(str(root)).why_no_devices(("nvidia.com/gpu",))
    assert "functions of nvidia.com/gpu 8 with no driver bound" in why
    assert "devinject health" in why and "devinject doctor" in why


def test_a_kind_not_on_the_node_names_what_is():
    why = Node(str(HOSTS / "mi300x")).why_no_devices(("nvidia.com/gpu",))
    assert "found instead: amd.com/gpu" in why


def test_an_unknown_kind_lists_the_known_ones():
    why = Node(str(HOSTS / "mi300x")).why_no_devices(("nvidia.com/gpuu",))
    assert "nvidia.com/gpuu is no kind of the loaded profiles" in why and "nvidia.com/gpu" in why


@pytest.mark.parametrize("command", [["list"], ["generate", "--output", "-"], ["topo"], ["health"]])
def test_every_command_that_finds_nothing_says_why(command):
    code, output = _run(*command, "--root", str(HOSTS / "empty-vm"))
    assert code == 0
    assert "3 PCI functions under " in output and len(output.strip().splitlines()) == 1


def test_generate_of_an_unbound_kind_fails_and_writes_nothing(host_copy, tmp_path):
    root = host_copy("hgx-h100")
    _unbind_gpus(root)
    out = tmp_path / "cdi"
    code, output = _run("generate", "--root", str(root), "--kind", "nvidia.com/gpu", "--output-dir", str(out))
    assert code == 1 and "no driver bound" in output and "nothing written" in output
    assert not out.exists()


def test_list_kind_filters_and_fails_on_a_missing_kind():
    code, output = _run("list", "--root", str(HOSTS / "hgx-h100"), "--kind", "nvidia.com/rdma",
                        "--state-dir", "/nonexistent")
    assert code == 0 and "nvidia.com/rdma=0" in output
    assert not any(line.startswith("nvidia.com/gpu=") for line in output.splitlines())
    code, output = _run("list", "--root", str(HOSTS / "hgx-h100"), "--kind", "amd.com/gpu",
                        "--state-dir", "/nonexistent")
    assert code == 1 and "found instead: nvidia.com/gpu 8, nvidia.com/rdma 8" in output
