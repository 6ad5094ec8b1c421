"""The ledger is never wedged and never fooled: zombies are dead, a broken ledger file is rebuilt from live
evidence, entries are validated, a reused container id is not waved through, events stay bounded."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from devinject.cdi.model import DeviceNode
from devinject.core.errors import LedgerError
from devinject.hook.plan import node_identity
from devinject.nodestate import events
from devinject.nodestate.ledger import Claim, Ledger, process_start_time
from tests.e2e.conftest import UNBOOKED_MAJOR, UNLISTED_NODE, held_in_a_container, stand_ins

POLICY = {"vendor.com/gpu": "exclusive"}
MAJOR = UNBOOKED_MAJOR  # a rebuild here reads the live node's evidence
NULL = os.stat("/dev/null")
NULL_NODE = f"c {os.major(NULL.st_rdev)}:{os.minor(NULL.st_rdev)}"
UNLISTED = f"c {os.major(os.stat(UNLISTED_NODE).st_rdev)}:{os.minor(os.stat(UNLISTED_NODE).st_rdev)}"


def claim(*nodes: str, name: str = "vendor.com/gpu=0") -> tuple[Claim, ...]:
    return (Claim(name, nodes),)


def wait_for_state(pid: int, state: bytes) -> None:
    for _ in range(200):
        with open(f"/proc/{pid}/stat", "rb") as handle:
            if handle.read().rsplit(b")", 1)[1].split()[0] == state:
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never reached state {state!r}")


def logged(state_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (state_dir / "events.jsonl").read_text().splitlines()]


def test_a_zombie_container_process_is_dead_and_its_device_reclaimed(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        ledger = Ledger(str(tmp_path))
        ledger.book("killed", child.pid, claim(f"c {MAJOR}:0"), POLICY)
        child.kill()  # SIGKILLed, and its parent (this test) does not reap it yet
        wait_for_state(child.pid, b"Z")
        assert process_start_time(child.pid) is None
        ledger.book("next", os.getpid(), claim(f"c {MAJOR}:0"), POLICY)
        assert sorted(ledger.snapshot()["allocations"]) == ["next"]
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(("content", "reason"), [
    (b'{"allocations": {"c1": {"exclus', "unreadable"),
    (b"\xff\xfe garbage", "unreadable"),
    (b"[]", "not a devinject ledger"),
    (json.dumps({"allocations": {"c1": {"devices": [], "exclusive": f"c {MAJOR}:0", "shared": [], "pid": 1,
                                        "start_time": 1, "state": "active"}}}).encode(),
     "allocation c1: exclusive is not a list of strings"),
    (json.dumps({"allocations": {"c1": {"devices": [], "exclusive": [], "shared": [], "pid": "1",
                                        "start_time": 1, "state": "active"}}}).encode(),
     "allocation c1: pid is not an integer"),
    # a float out of range parsed as inf: the ledger then could not be written back, and the lock was held
    (b'{"allocations": {"c1": {"devices": [], "exclusive": [], "shared": [], "pid": 1, "start_time": 1, '
     b'"state": "active", "time": 1e400}}}', "unreadable"),
])
def test_a_broken_ledger_is_moved_aside_and_the_node_goes_on(tmp_path: Path, content: bytes, reason: str) -> None:
    (tmp_path / "ledger.json").write_bytes(content)
    Ledger(str(tmp_path), proc="/proc").book("c2", os.getpid(), claim(f"c {MAJOR}:0"), POLICY)
    (aside,) = tmp_path.glob("ledger.json.broken-*")
    assert aside.read_bytes() == content  # kept for forensics
    data = json.loads((tmp_path / "ledger.json").read_text())
    assert data["allocations"]["c2"]["exclusive"] == [f"c {MAJOR}:0"]
    (event,) = [e for e in logged(tmp_path) if e["event"] == "ledger-rebuilt"]
    assert str(event["reason"]).startswith(reason) and event["moved_to"] == str(aside)


def test_rebuild_books_nodes_a_containers_process_holds_open(tmp_path: Path) -> None:
    st = os.stat(UNLISTED_NODE)
    node = f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    with held_in_a_container(UNLISTED_NODE) as holder:
        (tmp_path / "ledger.json").write_text("{truncated")
        # The host (this test) holding the node open is not a container's use; the container's is.
        with open(UNLISTED_NODE), pytest.raises(LedgerError, match="held by container recovered: "):
            Ledger(str(tmp_path)).book("c2", os.getpid(), claim(node), POLICY)
        recovered = json.loads((tmp_path / "ledger.json").read_text())["allocations"]
        assert recovered[f"recovered: open by pid {holder}"]["exclusive"] == [node]
        assert Ledger(str(tmp_path)).book("c3", os.getpid(), claim(f"c {MAJOR}:0"), POLICY).new  # others are free
    Ledger(str(tmp_path)).book("c4", os.getpid(), claim(node), POLICY)  # its process gone: free again


def test_rebuild_books_nodes_a_v1_device_cgroup_allows(tmp_path: Path, v1_device_cgroup: Path) -> None:
    group = v1_device_cgroup
    with stand_ins(1) as (container,):
        (group / "cgroup.procs").write_text(str(container.pid))
        (group / "devices.deny").write_text("a")
        (group / "devices.allow").write_text(f"{UNLISTED} rwm")
        (tmp_path / "ledger.json").write_text("")
        with pytest.raises(LedgerError, match=f"held by container recovered: cgroup v1 {group}"):
            Ledger(str(tmp_path)).book("c2", os.getpid(), claim(UNLISTED), POLICY)


def test_a_reused_container_id_is_not_waved_through(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "60"])
    try:
        ledger = Ledger(str(tmp_path))
        ledger.book("same-id", other.pid, claim(f"c {MAJOR}:0"), POLICY)
        with pytest.raises(LedgerError, match="the id is booked for another live process"):
            ledger.book("same-id", os.getpid(), claim(f"c {MAJOR}:1"), POLICY)
        assert not ledger.book("same-id", other.pid, claim(f"c {MAJOR}:0"), POLICY).new  # a real re-run is one
    finally:
        other.kill()
        other.wait()
    with held_in_a_container("/dev/null"):  # the dead container's node is still held: it stays reclaiming
        ledger = Ledger(str(tmp_path), reclaim_timeout=3600)
        dead = subprocess.Popen(["sleep", "60"])
        ledger.book("reused", dead.pid, claim(NULL_NODE), POLICY)
        dead.kill()
        dead.wait()
        assert ledger.book("reused", os.getpid(), claim(f"c {MAJOR}:5"), POLICY).new
        allocations = ledger.snapshot()["allocations"]
        assert allocations["reused"]["exclusive"] == [f"c {MAJOR}:5"]
        (old,) = [k for k in allocations if k.startswith("reused@")]
        assert allocations[old]["state"] == "reclaiming" and allocations[old]["exclusive"] == [NULL_NODE]
        with pytest.raises(LedgerError, match=f"held by container {old}"):
            ledger.book("third", os.getpid(), claim(NULL_NODE), POLICY)


def test_a_node_without_numbers_in_the_spec_is_booked_by_the_host_nodes_identity() -> None:
    node = DeviceNode("/dev/vendor0", host_path="/dev/null")
    assert node_identity(node) == NULL_NODE
    assert node_identity(DeviceNode("/dev/vendor0", type="c", major=195, minor=3)) == "c 195:3"


def test_events_file_is_rotated_not_grown_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_EVENTS_BYTES", 4096)
    for index in range(500):
        events.record(str(tmp_path), "allocated", container=f"c{index}")
    current, rotated = tmp_path / "events.jsonl", tmp_path / "events.jsonl.1"
    assert current.stat().st_size <= 4096 and rotated.stat().st_size <= 4096
    assert json.loads(current.read_text().splitlines()[-1])["container"] == "c499"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]


def test_the_lock_is_released_whatever_fails_after_it_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """A failure between taking the lock and handing the contents over (here the check of what was read)
    released nothing: a long-lived agent then held the node's ledger lock and every hook timed out."""
    from devinject.nodestate import ledger as ledger_module

    Ledger(str(tmp_path)).book("c1", os.getpid(), claim(f"c {MAJOR}:0"), POLICY)
    real = ledger_module.ledger_problem

    def failing(data: object) -> str | None:
        raise ValueError("the check failed")

    monkeypatch.setattr(ledger_module, "ledger_problem", failing)
    with pytest.raises(ValueError, match="the check failed"), Ledger(str(tmp_path)).locked():
        pass
    monkeypatch.setattr(ledger_module, "ledger_problem", real)
    taker = subprocess.run(["flock", "--nonblock", str(tmp_path / "ledger.lock"), "true"], timeout=10)
    assert taker.returncode == 0, "the ledger lock is still held"
