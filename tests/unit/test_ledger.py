import json
import multiprocessing
import os
import subprocess
import time

import pytest

from devinject.core.errors import LedgerError
from devinject.nodestate.ledger import Claim, Ledger, holders_of, process_start_time
from tests.e2e.conftest import held_in_a_container

POLICY = {"vendor.com/gpu": "exclusive", "vendor.com/nic": "shared"}


def _claims(*names: str) -> tuple[Claim, ...]:
    claims = []
    for name in names:
        kind, _, dev = name.partition("=")
        minors = range(8) if dev == "all" else [int(dev) if dev.isdigit() else int(dev.split("-")[1])]
        major = 195 if kind.endswith("gpu") else 231
        claims.append(Claim(name, tuple(f"c {major}:{m}" for m in minors)))
    return tuple(claims)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_exclusive_device_cannot_be_booked_twice_and_error_names_the_holder(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.book("c1", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    with pytest.raises(LedgerError, match="held by container c1"):
        ledger.book("c2", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)


def test_other_names_of_the_same_node_conflict_too(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.book("c1", os.getpid(), _claims("vendor.com/gpu=3"), POLICY)
    with pytest.raises(LedgerError, match="c 195:3"):
        ledger.book("c2", os.getpid(), _claims("vendor.com/gpu=all"), POLICY)
    with pytest.raises(LedgerError):
        ledger.book("c3", os.getpid(), _claims("vendor.com/gpu=GPU-3"), POLICY)


def test_shared_devices_can_be_booked_by_many(tmp_path):
    ledger = Ledger(str(tmp_path))
    for cid in ("a", "b", "c"):
        ledger.book(cid, os.getpid(), _claims("vendor.com/nic=0"), POLICY)
    assert sorted(ledger.snapshot()["allocations"]) == ["a", "b", "c"]


def test_rebooking_the_same_container_is_idempotent(tmp_path):
    ledger = Ledger(str(tmp_path))
    first = ledger.book("c1", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    again = ledger.book("c1", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    assert first.new and not again.new
    again.cancel()  # a failed re-run must not free the first run's booking
    assert "c1" in ledger.snapshot()["allocations"]


def test_poststop_releases_once_and_second_is_a_noop(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.book("c1", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    assert ledger.release("c1") == "released"
    assert ledger.release("c1") == "already released"
    assert ledger.release("never") == "not allocated"
    ledger.book("c2", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events.count("poststop") == 1  # the second poststop changed nothing


def test_dead_container_is_reclaimed_even_with_a_reused_pid(tmp_path):
    ledger = Ledger(str(tmp_path))
    doomed = subprocess.Popen(["sleep", "60"])
    ledger.book("gone", doomed.pid, _claims("vendor.com/gpu=0"), POLICY)
    doomed.kill()  # SIGKILL: no poststop ever comes
    doomed.wait()
    ledger.book("next", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    data = json.loads((tmp_path / "ledger.json").read_text())
    data["allocations"]["next"]["start_time"] = 1  # same pid, different start time: a reused pid
    (tmp_path / "ledger.json").write_text(json.dumps(data))
    ledger.book("third", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events.count("container-gone") == 2


def test_released_device_stays_reclaiming_while_a_container_process_holds_its_node(tmp_path):
    st = os.stat("/dev/full")  # a node nobody else here holds (pytest keeps /dev/null open)
    node = f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    claims = (Claim("vendor.com/gpu=0", (node,)),)
    ledger = Ledger(str(tmp_path), reclaim_timeout=3600)
    ledger.book("c1", os.getpid(), claims, POLICY)
    with held_in_a_container("/dev/full") as holder:  # a container's process outlives its poststop
        assert ledger.release("c1") == "released"
        assert holder in holders_of({node}, containers_only=True)[node]
        with pytest.raises(LedgerError, match=r"held by container c1 \(reclaiming"):
            ledger.book("c2", os.getpid(), claims, POLICY)
    assert ledger.book("c2", os.getpid(), claims, POLICY).new  # closed: the next booking finishes the release
    assert "c1" not in ledger.snapshot()["allocations"]


def test_a_dead_container_with_its_own_pid_namespace_is_freed_without_a_scan(tmp_path, monkeypatch):
    """The kernel ends every process of a pid namespace before its init's exit completes: once such a
    container's init is gone, nothing of it can hold a node, and its devices are free without a /proc scan."""
    import signal

    from devinject.nodestate import ledger as ledger_module
    from tests.e2e.conftest import pid_namespace_init

    with pid_namespace_init() as init:
        ledger = Ledger(str(tmp_path), reclaim_timeout=3600)
        ledger.book("c1", init, _claims("vendor.com/gpu=0"), POLICY)
        assert ledger.snapshot()["allocations"]["c1"]["own_pid_ns"] is True
        os.kill(init, signal.SIGKILL)
        for _ in range(500):  # until its parent has reaped it
            if process_start_time(init) is None:
                break
            time.sleep(0.01)

        def no_scan(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("scanned /proc for a container that left nobody behind")

        monkeypatch.setattr(ledger_module, "holders_of", no_scan)
        assert ledger.book("c2", os.getpid(), _claims("vendor.com/gpu=0"), POLICY).new
        assert "c1" not in ledger.snapshot()["allocations"]
        assert ledger.snapshot()["allocations"]["c2"]["own_pid_ns"] is False  # this process: the host's
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[-2:] == ["released", "allocated"]


def test_a_host_daemon_holding_the_node_does_not_keep_a_release_waiting(tmp_path):
    """A persistence daemon keeps every GPU open on the host: not a container's use. It does not stop the
    first booking, so it does not stop the next one either."""
    st = os.stat("/dev/full")
    node = f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    claims = (Claim("vendor.com/gpu=0", (node,)),)
    ledger = Ledger(str(tmp_path), reclaim_timeout=3600)
    with open("/dev/full"):  # this process: the host's mount namespace
        ledger.book("c1", os.getpid(), claims, POLICY)
        assert ledger.release("c1") == "released"
        assert os.getpid() in holders_of({node})[node] and holders_of({node}, containers_only=True) == {}
        assert ledger.book("c2", os.getpid(), claims, POLICY).new
    assert "c1" not in ledger.snapshot()["allocations"]


def test_unhealthy_node_is_never_allocated(tmp_path):
    (tmp_path / "health.json").write_text(json.dumps({"unhealthy_nodes": ["c 195:0"]}))
    with pytest.raises(LedgerError, match="unhealthy"):
        Ledger(str(tmp_path)).book("c1", os.getpid(), _claims("vendor.com/gpu=0"), POLICY)


def test_process_start_time():
    assert process_start_time(os.getpid()) is not None
    assert process_start_time(_dead_pid()) is None


def _contend(args):
    state_dir, index = args
    device = index % 8
    try:
        Ledger(state_dir).book(f"c{index}", os.getpid(), _claims(f"vendor.com/gpu={device}"), POLICY)
        return device
    except LedgerError:
        return None


def test_fifty_parallel_bookings_for_eight_devices_never_double_allocate(tmp_path):
    for _round in range(3):
        with multiprocessing.get_context("fork").Pool(16) as pool:
            winners = pool.map(_contend, [(str(tmp_path), i + 100 * _round) for i in range(50)])
        data = json.loads((tmp_path / "ledger.json").read_text())
        held = [n for e in data["allocations"].values() for n in e["exclusive"]]
        assert len(held) == len(set(held)) == 8  # every device once, none twice
        assert sorted(w for w in winners if w is not None) == list(range(8))  # every round, not just the first
        for cid in list(data["allocations"]):
            Ledger(str(tmp_path)).release(cid)


def test_the_shipped_profiles_decide_sharing_when_no_policy_is_given(tmp_path):
    """Without an explicit policy the ledger asks the profiles: RDMA NICs are shared, GPUs exclusive."""
    from devinject.nodestate.profilefacts import sharing_policy

    policy = sharing_policy(str(tmp_path))
    assert policy["nvidia.com/rdma"] == "shared" and policy["nvidia.com/gpu"] == "exclusive"
    ledger = Ledger(str(tmp_path))
    nic = (Claim("nvidia.com/rdma=0", ("c 231:192",)),)
    assert ledger.book("a", os.getpid(), nic).new and ledger.book("b", os.getpid(), nic).new
    gpu = (Claim("nvidia.com/gpu=0", ("c 195:0",)),)
    ledger.book("c", os.getpid(), gpu)
    with pytest.raises(LedgerError, match="held by container c"):
        ledger.book("d", os.getpid(), gpu)


def test_sharing_honours_profile_dirs(tmp_path):
    """An admin profile in a --profile-dir that makes a kind shared is what the ledger then enforces."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "acme.yaml").write_text("name: acme\nkind: acme.example/npu\nmatch: {vendor: ['1da4']}\n"
                                        "sharing: shared\n")
    nodes = (Claim("acme.example/npu=0", ("c 240:0",)),)
    state = tmp_path / "state"
    exclusive = Ledger(str(state))  # without the directory: an unknown kind is exclusive
    exclusive.book("a", os.getpid(), nodes)
    with pytest.raises(LedgerError):
        exclusive.book("b", os.getpid(), nodes)
    shared = Ledger(str(tmp_path / "state2"), profile_dirs=(str(profiles),))
    assert shared.book("a", os.getpid(), nodes).new and shared.book("b", os.getpid(), nodes).new
    (profiles / "acme.yaml").write_text("name: acme\nkind: acme.example/npu\nmatch: {vendor: ['1da4']}\n"
                                        "sharing: exclusive\n")  # the cache follows the file
    other = (Claim("acme.example/npu=1", ("c 240:1",)),)
    again = Ledger(str(tmp_path / "state2"), profile_dirs=(str(profiles),))
    again.book("c", os.getpid(), other)
    with pytest.raises(LedgerError):
        again.book("d", os.getpid(), other)


