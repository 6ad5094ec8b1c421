"""Every command's real --json, on every fixture host (the empty ones too), against the one schema per
command in docs/json.md: one vocabulary (name, kind, pci_address, numa_node, health, reasons, holders), a JSON
array from every command but topo's documented object, and something printed on an empty host.

The CLI runs as `python -m devinject` in a fresh process, so that PYTHONPATH can point it at another tree."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from tests.conftest import HOST_NAMES, HOSTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "json.md"
COMMANDS = ("list", "health", "topo", "who", "events", "validate", "doctor")
HELD = "workstation-held"  # a copy whose iGPU node has /dev/null's numbers, held open, booked in the ledger
EMPTY = "empty-root"  # a root with nothing in it at all
NUMA_UNKNOWN = "numa-unknown"  # a topology host whose functions' numa_node is -1
IMEX = "nvidia.com/imex-channel"


def schemas() -> dict[str, dict[str, Any]]:
    """command -> its schema (with the shared $defs), from docs/json.md's ```json <command> blocks."""
    blocks = dict(re.findall(r"^```json (\S+)\n(.*?)^```", DOC.read_text(), re.S | re.M))
    defs = json.loads(blocks.pop("$defs"))
    found = {command: {"$schema": "https://json-schema.org/draft/2020-12/schema", **json.loads(text),
                       "$defs": defs} for command, text in blocks.items()}
    for schema in found.values():
        Draft202012Validator.check_schema(schema)
    return found


def cli(*args: str, ok: tuple[int, ...] = (0,)) -> Any:
    done = subprocess.run([sys.executable, "-m", "devinject", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode in ok, done.stderr
    try:
        return json.loads(done.stdout)
    except ValueError:
        return done.stdout  # not JSON (nothing at all, say): what the schema then refuses


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, topology_hosts: Path) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("json-hosts")
    found = {name: HOSTS / name for name in HOST_NAMES}
    found[NUMA_UNKNOWN] = topology_hosts / NUMA_UNKNOWN
    (base / EMPTY).mkdir()
    found[EMPTY] = base / EMPTY
    held = base / HELD
    shutil.copytree(HOSTS / "workstation", held, symlinks=True)
    card = next(held.glob("sys/devices/pci0000:00/0000:00:02.0/drm/card0"))
    (card / "dev").write_text("1:3\n")
    found[HELD] = held
    return found


def _state(tmp_path: Path, root: Path) -> Path:
    """A state dir with the ledger booking the host's first device for a container, and events of its first
    device as watch records them (a verdict with reasons, a take-out, a put-back with its status)."""
    from devinject.discovery.discover import discover
    from devinject.discovery.host import Host
    from devinject.discovery.profiles import load_profiles
    from devinject.nodestate import events
    from devinject.nodestate.ledger import Claim, Ledger

    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    found = discover(Host(str(root)), load_profiles(Host(str(root))))
    if found:
        first = found[0]
        nodes = tuple(f"c {n.major}:{n.minor}" for n in first.nodes)
        name = f"{first.profile.kind}={first.index}"
        Ledger(str(state)).book("ctr-1", os.getpid(), (Claim(name, nodes),), {first.profile.kind: "exclusive"})
        key = f"{first.profile.kind}={first.address}"
        events.record(str(state), "degraded", key, reasons=["link at 8 GT/s, capable of 16 GT/s"])
        events.record(str(state), "taken-out", key, reasons=["Xid 79"])
        events.record(str(state), "put-back", key, status="healthy")
    return state


def outputs(root: Path, state: Path, tmp_path: Path) -> dict[str, Any]:
    """command -> its --json on the host under `root`."""
    specs = tmp_path / "cdi"
    specs.mkdir()
    if any(specs.parent.glob("state/ledger.json")):  # a host with devices (one is booked)
        subprocess.run([sys.executable, "-m", "devinject", "generate", "--root", str(root), "--output-dir",
                        str(specs), "--hook-path", "/usr/bin/devinject"], check=True, capture_output=True, timeout=60)
        first = sorted(specs.iterdir())[0]
        (specs / "broken.yaml").write_text(first.read_text().replace("cdiVersion:", "cdiVersion: 9.9.9\nx:", 1))
    with open("/dev/null"):  # held open: the HELD host's iGPU node has its numbers
        held = cli("who", "--root", str(root), "--state-dir", str(state), "--json")
    return {
        "list": cli("list", "--root", str(root), "--state-dir", str(state), "--json"),
        "health": cli("health", "--root", str(root), "--json", ok=(0, 1)),
        "topo": cli("topo", "--root", str(root), "--json"),
        "who": held,
        "events": cli("events", "--state-dir", str(state), "--json"),
        "validate": cli("validate", "--json", str(specs), ok=(0, 1)),
        "doctor": cli("doctor", "--root", str(root), "--state-dir", str(state), "--spec-dir", str(specs), "--json",
                      ok=(1,)),  # fixture nodes are regular files: the nodes link is broken on every host
    }


@pytest.fixture(scope="module")
def every_output(hosts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    found = {}
    for name, root in hosts.items():
        tmp = tmp_path_factory.mktemp(f"json-{name}")
        found[name] = outputs(root, _state(tmp, root), tmp)
    return found


def test_docs_json_has_one_schema_per_json_command() -> None:
    assert set(schemas()) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_json_on_every_host_is_what_docs_json_says(command: str,
                                                                  every_output: dict[str, dict[str, Any]]) -> None:
    validator = Draft202012Validator(schemas()[command])
    wrong = [f"{host}: {'/'.join(map(str, error.absolute_path))}: {error.message}"
             for host, out in sorted(every_output.items()) for error in validator.iter_errors(out[command])]
    assert not wrong, "\n".join(wrong[:20])


def test_an_empty_host_prints_empty_json_not_nothing(every_output: dict[str, dict[str, Any]]) -> None:
    empty = every_output[EMPTY]
    assert empty["topo"] == {"devices": {}, "matrix": {}, "pairs": []}
    assert [empty[c] for c in ("list", "health", "who", "events", "validate", "doctor")] == [[], [], [], [], [], []]


def test_the_outputs_hold_what_the_schemas_check(every_output: dict[str, dict[str, Any]]) -> None:
    """Not vacuous: the hosts give every field a value that the schema constrains (holders, pairs, null NUMA
    nodes, events with reasons and health, problems)."""
    held = every_output[HELD]
    assert held["list"][0]["holders"] == [{"pid": os.getpid(), "container": "ctr-1", "command": None,
                                           "node": None, "state": "active"}]
    assert held["list"][0]["allocation"] == "allocated"
    assert ("intel.com/gpu=0", "c 1:3", os.getpid()) in {(r["name"], r["node"], r["pid"]) for r in held["who"]}
    hgx = every_output["hgx-h100"]
    pair = hgx["topo"]["pairs"][0]
    assert (pair["gpu"], pair["nic"], pair["gpu_name"], pair["relation"]) == ("GPU0", "NIC0", "nvidia.com/gpu=0",
                                                                              "PIX")
    gpu0 = hgx["topo"]["devices"]["GPU0"]
    assert {(d["name"], d["pci_address"]) for d in hgx["list"]} == {
        (d["name"], d["pci_address"]) for d in hgx["health"]} >= {(gpu0["name"], gpu0["pci_address"])}
    assert [e["event"] for e in hgx["events"]] == ["degraded", "taken-out", "put-back"]
    assert hgx["events"][2]["health"] == "healthy" and hgx["events"][1]["reasons"] == ["Xid 79"]
    unknown = every_output[NUMA_UNKNOWN]
    assert None in {d["numa_node"] for d in unknown["list"]}
    assert None in {d["numa_node"] for d in unknown["topo"]["devices"].values()}
    assert any(p["severity"] == "error" and p["file"].endswith("broken.yaml") for p in hgx["validate"])
    assert [(c["link"], c["ok"]) for c in hgx["doctor"][0]["checks"]][:4] == [
        ("pci", True), ("driver", True), ("nodes", False), ("libraries", None)]
    dgx = every_output["dgx-a100-mig"]  # IMEX channels: devices with no PCI function, pci_address null
    channels = [(d["name"], d["pci_address"], d["functions"]) for d in dgx["list"] if d["kind"] == IMEX]
    assert channels == [(f"{IMEX}=0", None, []), (f"{IMEX}=1", None, [])]
    assert [(d["name"], d["pci_address"]) for d in dgx["health"] if d["kind"] == IMEX] == [
        (f"{IMEX}=0", None), (f"{IMEX}=1", None)]


def test_the_list_schema_ties_a_null_pci_address_to_a_device_without_pci_fields(
        every_output: dict[str, dict[str, Any]]) -> None:
    """A channel's row has no functions, PCI ID or NUMA node; a PCI device's row has its functions: either
    mixed up is refused."""
    validator = Draft202012Validator(schemas()["list"])
    rows = every_output["dgx-a100-mig"]["list"]
    channel = next(r for r in rows if r["kind"] == IMEX)
    gpu = next(r for r in rows if r["kind"] == "nvidia.com/gpu")
    assert validator.is_valid([channel, gpu])
    for wrong in ({**channel, "functions": [gpu["pci_address"]]}, {**channel, "pci_id": gpu["pci_id"]},
                  {**channel, "numa_node": 0}, {**gpu, "functions": []}, {**gpu, "pci_id": None}):
        assert not validator.is_valid([wrong]), wrong


def test_list_and_topo_name_a_devices_pairs_alike(every_output: dict[str, dict[str, Any]]) -> None:
    """One vocabulary for GPU-NIC pairs: `topo --json`'s devices and `list --json`'s rows both say
    `paired_with: [{name, relation}]`, and the same pairs (topo said only `gpu_name`/`nic_name`, now deprecated)."""
    compared = 0
    for host, out in sorted(every_output.items()):
        listed = {row["name"]: row["paired_with"] for row in out["list"]}
        for device in out["topo"]["devices"].values():
            assert device["paired_with"] == listed[device["name"]], (host, device["name"])
            compared += bool(device["paired_with"])
        for pair in out["topo"]["pairs"]:  # the deprecated keys still say the same names
            devices = out["topo"]["devices"]
            assert (pair["gpu_name"], pair["nic_name"]) == (devices[pair["gpu"]]["name"], devices[pair["nic"]]["name"])
            assert {"name": pair["nic_name"], "relation": pair["relation"]} in devices[pair["gpu"]]["paired_with"]
    assert compared >= 16  # hgx-h100 alone: 8 GPUs and 8 NICs, each paired
