"""The ledger enforces time-slicing: a kind the device plugin time-slices N ways (its `sharing.json` in the state
dir) is booked shared by containers, at most N of them per device; a DRA claim without a sharing config stays
exclusive, so it never meets them (either order); the count holds across a ledger rebuilt from live evidence;
`list` shows how each device is shared and by how many. Before, a second container on a time-sliced GPU
was refused (exclusive), and nothing counted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devinject.core.errors import LedgerError
from devinject.nodestate.ledger import Claim, Ledger
from devinject.nodestate.profilefacts import sharing_policy, time_slicing, write_time_slicing
from tests.e2e.conftest import stand_ins
from tests.unit.test_ledger_pods import NODE

KIND = "nvidia.com/gpu"
GPU = (Claim(f"{KIND}=0", (NODE,)),)


@pytest.fixture
def state(tmp_path: Path) -> str:
    path = tmp_path / "state"
    path.mkdir(mode=0o755)
    write_time_slicing(str(path), {KIND: 2})
    return str(path)


def test_the_plugins_time_slicing_makes_its_kind_shared_for_containers_only(state: str) -> None:
    assert time_slicing(state) == {KIND: 2}
    assert sharing_policy(state)[KIND] == "shared"
    assert sharing_policy(state, containers=False)[KIND] == "exclusive"  # the profile's, for DRA claims
    Path(state, "sharing.json").write_text('{"time-slicing": {"nvidia.com/gpu": "all"}}')
    assert time_slicing(state) == {}  # not a count: nothing is shared
    Path(state, "sharing.json").write_text("{")
    assert time_slicing(state) == {} and sharing_policy(state)[KIND] == "exclusive"


def test_a_time_sliced_gpu_holds_at_most_its_replicas_containers(state: str) -> None:
    ledger = Ledger(state)
    with stand_ins(3) as (one, two, three):
        ledger.book("c1", one.pid, GPU)
        ledger.book("c2", two.pid, GPU)  # a second pod's container on the same GPU: shared
        with pytest.raises(LedgerError, match=r"nvidia.com/gpu=0: time-sliced 2 ways and held by 2 containers"):
            ledger.book("c3", three.pid, GPU)
        assert ledger.release("c1") == "released"
        ledger.sweep()
        ledger.book("c3", three.pid, GPU)  # one gone: room again
        entry = ledger.snapshot()["allocations"]["c3"]
        assert entry["shared"] == [NODE] and entry["exclusive"] == []


def test_an_exclusive_claim_never_meets_time_sliced_containers(state: str) -> None:
    ledger = Ledger(state)
    with stand_ins(2) as (one, two):
        ledger.book("c1", one.pid, GPU)
        with pytest.raises(LedgerError, match="is held by container c1"):
            ledger.book("dra-claim:dra.devinject.io:u1", 1, GPU, for_pods=("pod-a",))
        ledger.release("c1")
        ledger.sweep()
        ledger.book("dra-claim:dra.devinject.io:u1", 1, GPU, for_pods=("pod-a",))
        with pytest.raises(LedgerError, match="is held by container dra-claim:dra.devinject.io:u1"):
            ledger.book("c2", two.pid, GPU)


def test_the_count_holds_across_a_rebuild_from_live_evidence(state: str, v1_device_cgroup: Path) -> None:
    import time

    ledger = Ledger(state)
    groups = [v1_device_cgroup / "one", v1_device_cgroup / "two"]  # a device cgroup per container, as runc's
    try:
        with stand_ins(3) as (one, two, three):
            for group, process in zip(groups, (one, two), strict=True):
                group.mkdir()
                (group / "devices.deny").write_text("a")
                (group / "devices.allow").write_text(f"{NODE} rw")
                (group / "cgroup.procs").write_text(str(process.pid))
            ledger.book("c1", one.pid, GPU)
            ledger.book("c2", two.pid, GPU)
            Path(state, "ledger.json").write_text('{"allocations": {"c1": {"exclus')  # lost
            with pytest.raises(LedgerError, match="time-sliced 2 ways and held by 2 containers"):
                Ledger(state).book("c3", three.pid, GPU)
            rebuilt = Ledger(state).snapshot()["allocations"]
            holding = [e["pid"] for e in rebuilt.values() if NODE in e["exclusive"] + e["shared"]]
            assert sorted(holding) == sorted([one.pid, two.pid])  # (the machine's other holdings aside)
    finally:
        for group in groups:
            for _ in range(100):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def test_list_shows_how_each_gpu_is_shared_and_by_how_many(state: str) -> None:
    from tests.conftest import HOSTS
    from tests.unit.test_cli import run

    ledger = Ledger(state)
    gpu0 = (Claim(f"{KIND}=0", ("c 195:0",)),)  # the HGX fixture's first GPU node, /dev/nvidia0
    with stand_ins(1) as (one,):
        ledger.book("c1", one.pid, gpu0)
        done = run("list", "--root", str(HOSTS / "hgx-h100"), "--state-dir", state, "--kind", KIND, "--json")
        rows = json.loads(done.stdout)
        assert {(r["sharing"], r["replicas"]) for r in rows} == {("time-slicing", 2)}
        done = run("list", "--root", str(HOSTS / "hgx-h100"), "--state-dir", state, "--kind", KIND)
        lines = done.stdout.splitlines()
        assert "SHARING" in lines[0]
        held = [line for line in lines if " c1 " in f"{line} "]
        assert len(held) == 1 and "time-slicing 1/2" in held[0], done.stdout
        assert all("time-slicing 0/2" in line for line in lines[1:] if line not in held)
    os.unlink(os.path.join(state, "sharing.json"))
    rows = json.loads(run("list", "--root", str(HOSTS / "hgx-h100"), "--state-dir", state, "--kind", KIND,
                          "--json").stdout)
    assert {r["sharing"] for r in rows} == {"exclusive"}


def test_who_says_a_held_gpu_is_time_sliced(host_copy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.test_cli import run

    root = host_copy("workstation")
    card = next(root.glob("sys/devices/pci0000:00/0000:00:02.0/drm/card0"))
    (card / "dev").write_text("1:3\n")  # the iGPU's card node as /dev/null's numbers, which we can hold open
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    write_time_slicing(str(state), {"intel.com/gpu": 3})
    with open("/dev/null"):  # held open for the scan
        done = run("who", "--root", str(root), "--state-dir", str(state))
    line = next(line for line in done.stdout.splitlines() if line.startswith("intel.com/gpu=0 ") and
                f" pid {os.getpid()} " in line)
    assert line.endswith("(time-sliced 3 ways)"), done.stdout
