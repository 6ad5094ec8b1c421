"""docs/lifecycle.md's exit codes, held for every command: each one that takes a --root, --state-dir,
--profile-dir or DEVICE is run against each bad input and must answer one line naming it, with the table's exit
code, before it reads, writes or serves anything. The commands are read from the CLI itself, so a new one is
covered (or this test asks for its required arguments)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import click
import pytest

from devinject.cli import cli
from tests.conftest import HOSTS
from tests.unit.test_cli import DEVINJECT

HGX = str(HOSTS / "hgx-h100")
# what each command needs besides the option under test (an agent: places of its own, so that a wrong option it
# missed would show as a started agent writing there, not as one touching the machine's)
EXTRA: dict[str, list[str]] = {
    "dra-driver": ["--node-name", "node-a", "--plugin-dir", "{tmp}/plugins", "--registry-dir", "{tmp}/registry",
                   "--cdi-dir", "{tmp}/cdi", "--metrics-address", "", "--no-uevents"],
    "device-plugin": ["--plugin-dir", "{tmp}/plugins", "--metrics-address", "", "--no-uevents",
                      "--output-dir", "{tmp}/out"],
    "watch": ["--no-uevents", "--output-dir", "{tmp}/out"],
    "install-node-hook": ["--check"],
}


def _commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(_commands(command, (*prefix, name)))
        else:
            found[" ".join((*prefix, name))] = command
    return found


def _taking(param: str) -> list[str]:
    return sorted(name for name, command in _commands().items() if any(p.name == param for p in command.params))


def _run(command: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    extra = [a.replace("{tmp}", str(tmp_path)) for a in EXTRA.get(command, [])]
    return subprocess.run([DEVINJECT, *command.split(), *args, *extra], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)


def _one_line(done: subprocess.CompletedProcess[str], code: int, starts: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, (done.returncode, done.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"devinject: error: {starts}"), done.stderr
    assert done.stdout == ""


def test_the_commands_under_test_are_the_ones_users_have() -> None:
    assert {"list", "generate", "topo", "health", "doctor", "who", "events", "put-back", "watch", "device-plugin",
            "dra-driver"} <= set(_taking("root"))
    assert set(_taking("device")) == {"doctor", "events", "who", "put-back"}


@pytest.mark.parametrize("command", _taking("root"))
def test_a_missing_root_is_exit_2_naming_it(tmp_path: Path, command: str) -> None:
    device = ["nvidia.com/gpu=0"] if command == "put-back" else []
    _one_line(_run(command, tmp_path, *device, "--root", str(tmp_path / "nowhere")), 2,
              f"--root {tmp_path / 'nowhere'}: no such directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no dir made


@pytest.mark.parametrize("command", _taking("state_dir"))
def test_a_state_dir_that_is_a_file_is_exit_2_naming_it(tmp_path: Path, command: str) -> None:
    state = tmp_path / "state"
    state.write_text("x")
    device = ["nvidia.com/gpu=0"] if command == "put-back" else []
    root = ["--root", HGX] if command != "events" else []
    _one_line(_run(command, tmp_path, *device, *root, "--state-dir", str(state)), 2,
              f"--state-dir {state}: not a directory")
    assert state.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["state"]


@pytest.mark.parametrize("command", _taking("profile_dirs"))
def test_a_profile_dir_that_is_not_there_is_exit_2_naming_it(tmp_path: Path, command: str) -> None:
    device = ["nvidia.com/gpu=0"] if command == "put-back" else []
    _one_line(_run(command, tmp_path, *device, "--root", HGX, "--profile-dir", str(tmp_path / "nowhere"),
                   *(["--state-dir", str(tmp_path / "state")] if command in _taking("state_dir") else [])), 2,
              f"--profile-dir {tmp_path / 'nowhere'}: no such directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", _taking("device"))
def test_an_unknown_device_is_exit_1_with_the_nearest_names(tmp_path: Path, command: str) -> None:
    _one_line(_run(command, tmp_path, "nvidia.com/gpu=42", "--root", HGX, "--state-dir", str(tmp_path / "state")),
              1, f"nvidia.com/gpu=42: no such device under {HGX}; did you mean ")


@pytest.mark.parametrize("command", ["generate", "list", "health", "who", "events"])
def test_a_kind_the_node_lacks_is_exit_1_saying_what_it_has(tmp_path: Path, command: str) -> None:
    """--kind wherever devices are listed (it was list's and generate's alone)."""
    extra = ["--hook-path", "/usr/bin/devinject", "--output", "-"] if command == "generate" else \
        ["--state-dir", str(tmp_path / "state")] if command != "health" else []
    _one_line(_run(command, tmp_path, "--root", HGX, "--kind", "amd.com/gpu", *extra), 1,
              f"no amd.com/gpu devices under {HGX}/sys/bus/pci/devices; found instead: nvidia.com/gpu 8")


def test_kind_keeps_only_that_kinds_rows(tmp_path: Path) -> None:
    import json

    rows = json.loads(_run("health", tmp_path, "--root", HGX, "--json", "--kind", "nvidia.com/rdma").stdout)
    assert len(rows) == 8 and {r["kind"] for r in rows} == {"nvidia.com/rdma"}
