"""Attacks on the ledger's integrity: a rebuilt ledger holds from the moment it is made, and only a container
the runtime started (its device cgroup grants the node by name) can hold a device in it — anyone's
namespace, an `O_PATH` handle or a monitoring agent keeping every GPU open holds nothing; a broken health
file passes no device; and no process reads the ledger's pids in another pid namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.core.errors import LedgerError
from devinject.nodestate import evidence
from devinject.nodestate.ledger import Claim, Ledger
from tests.e2e.conftest import (
    UNBOOKED_MAJOR,
    UNLISTED_NODE,
    held_in_a_container,
    node_holder,
    pid_namespace_init,
    require,
    stand_ins,
    world_reachable_node,
)

POLICY = {"vendor.com/gpu": "exclusive", "vendor.com/nic": "shared"}
NODE_STAT = os.stat(UNLISTED_NODE)  # no container's cgroup names it by default, nobody else here holds it
NOBODY = 65534
NODE = f"c {os.major(NODE_STAT.st_rdev)}:{os.minor(NODE_STAT.st_rdev)}"


def claim(node: str = NODE, name: str = "vendor.com/gpu=0") -> tuple[Claim, ...]:
    return (Claim(name, (node,)),)


def corrupt(state_dir: Path) -> None:
    state_dir.joinpath("ledger.json").write_text('{"allocations": {"c1": {"exclus')


def test_a_rebuild_holds_even_when_the_booking_that_made_it_is_refused(tmp_path: Path) -> None:
    """corrupt -> a clashing start (refused) -> the next start: refused too, while the holder lives."""
    with held_in_a_container(UNLISTED_NODE):
        corrupt(tmp_path)
        with pytest.raises(LedgerError, match="held by container recovered: "):
            Ledger(str(tmp_path)).book("b", os.getpid(), claim(), POLICY)
        assert json.loads((tmp_path / "ledger.json").read_text())["allocations"]  # written, not lost
        with pytest.raises(LedgerError, match="held by container recovered: "):
            Ledger(str(tmp_path)).book("c", os.getpid(), claim(), POLICY)
    assert Ledger(str(tmp_path)).book("c", os.getpid(), claim(), POLICY).new  # the holder gone: free


def test_a_rebuild_never_leaves_the_node_without_a_ledger_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """Kept aside by copy, replaced by rename: a crash at any point leaves a ledger, broken or rebuilt."""
    corrupt(tmp_path)
    seen: list[bool] = []
    real = evidence.collect

    def collect(proc: str = "/proc") -> list[evidence.Holding]:
        seen.append((tmp_path / "ledger.json").exists())
        return real(proc)

    monkeypatch.setattr(evidence, "collect", collect)
    Ledger(str(tmp_path)).book("b", os.getpid(), claim(f"c {UNBOOKED_MAJOR}:0"), POLICY)  # rebuilt from live evidence
    assert seen == [True]
    (aside,) = tmp_path.glob("ledger.json.broken-*")
    assert aside.read_text() == '{"allocations": {"c1": {"exclus'


@pytest.mark.parametrize("flags", [os.O_PATH, os.O_RDONLY], ids=["o-path", "open"])
def test_an_unprivileged_users_namespace_holding_a_node_is_no_container(tmp_path: Path, flags: int) -> None:
    """`unshare -Urm` as nobody, then open the node (O_PATH needs no permission at all): before, the next
    rebuild booked that process as an exclusive holder and every container was refused while it lived."""
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) not installed")
    with world_reachable_node(NODE_STAT.st_rdev) as node, \
            node_holder(node, cgroup_grants=False, flags=flags, uid=NOBODY) as attacker:
        assert os.stat(f"/proc/{attacker}/status").st_uid != 0
        corrupt(tmp_path)
        assert Ledger(str(tmp_path)).book("b", os.getpid(), claim(), POLICY).new
        bookings = json.loads((tmp_path / "ledger.json").read_text())["allocations"]
        assert [name for name, b in bookings.items() if NODE in b["exclusive"]] == ["b"]


def test_a_monitoring_agent_keeping_every_gpu_open_is_no_holder(tmp_path: Path) -> None:
    """A DCGM-style agent (root, a mount namespace of its own, an unrestricted device cgroup) keeps the
    node open for real: not a container's use, before or after a rebuild."""
    with node_holder(UNLISTED_NODE, cgroup_grants=False) as monitor:
        assert NODE in evidence.open_device_nodes(monitor)  # it does hold the node
        corrupt(tmp_path)
        assert Ledger(str(tmp_path)).book("b", os.getpid(), claim(), POLICY).new


def test_an_o_path_handle_is_not_an_open_device(tmp_path: Path) -> None:
    handle = os.open(UNLISTED_NODE, os.O_PATH)
    try:
        assert NODE not in evidence.open_device_nodes(os.getpid())
        with open(UNLISTED_NODE):
            assert NODE in evidence.open_device_nodes(os.getpid())
    finally:
        os.close(handle)


def test_an_outsider_cannot_keep_a_released_device_reclaiming(tmp_path: Path) -> None:
    """A booking of a container without a pid namespace of its own is released; an outsider's namespace
    holds the node: the next booking is not refused for the 30 s of a reclaim."""
    ledger = Ledger(str(tmp_path), reclaim_timeout=3600)
    ledger.book("a", os.getpid(), claim(), POLICY)
    with node_holder(UNLISTED_NODE, cgroup_grants=False):
        assert ledger.release("a") == "released"
        assert ledger.book("b", os.getpid(), claim(), POLICY).new
    assert "a" not in ledger.snapshot()["allocations"]


def test_a_recovered_booking_names_the_containers_init(tmp_path: Path, v1_device_cgroup: Path) -> None:
    """The booking is tied to the container's init (pid 1 of its pid namespace), not to whichever process
    the cgroup lists first: an `exec` that ends does not free a running container's device."""
    group = v1_device_cgroup
    with stand_ins(1) as (helper,), pid_namespace_init() as init:
        for pid in sorted((helper.pid, init)):
            (group / "cgroup.procs").write_text(str(pid))
        (group / "devices.deny").write_text("a")
        (group / "devices.allow").write_text(f"{NODE} rw")
        corrupt(tmp_path)
        with pytest.raises(LedgerError, match=f"pid {init}\\)"):
            Ledger(str(tmp_path)).book("b", os.getpid(), claim(), POLICY)


def test_a_recovered_holding_of_a_shared_kinds_node_is_shared(tmp_path: Path) -> None:
    """Evidence books what it finds exclusive, but a NIC (a shared kind) held by a recovered container is
    still granted to the next container that shares it; a GPU is not."""
    with held_in_a_container(UNLISTED_NODE):
        corrupt(tmp_path)
        with pytest.raises(LedgerError, match="held by container recovered: "):
            Ledger(str(tmp_path)).book("gpu", os.getpid(), claim(), POLICY)
        assert Ledger(str(tmp_path)).book("nic", os.getpid(), claim(name="vendor.com/nic=0"), POLICY).new


@pytest.mark.parametrize("content", ['{"unhealthy_nodes": ["c 195', '{"unhealthy_nodes": "c 195:0"}', "[]"])
def test_a_broken_health_file_refuses_rather_than_passes_a_failing_device(tmp_path: Path, content: str) -> None:
    """health.json is how the node agent takes a device out: read as "all healthy" when broken, it put
    every failing device back in service."""
    (tmp_path / "health.json").write_text(content)
    with pytest.raises(LedgerError, match=f"{tmp_path}/health.json: not a devinject health file"):
        Ledger(str(tmp_path)).book("b", os.getpid(), claim("c 195:0"), POLICY)
    assert not (tmp_path / "ledger.json").exists()


def _in_a_new_pid_namespace(call: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    """`print(Ledger(state_dir).<call>)` in a pid namespace (and /proc) of its own."""
    from tests.e2e.conftest import REPO

    return subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
         f"import sys\nfrom devinject.nodestate.ledger import Ledger\nprint(Ledger(sys.argv[1]).{call})\n",
         str(state_dir)], capture_output=True, text=True, timeout=60,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO / "src")})


def test_a_ledger_is_never_read_with_another_pid_namespaces_pids(tmp_path: Path) -> None:
    """An agent without the node's pid namespace (a pod without hostPID sharing /run/devinject, a nested
    runtime) read the host's pids as its own: every booking looked dead, and its sweep freed them all."""
    with stand_ins(1) as (container,):
        Ledger(str(tmp_path)).book("a", container.pid, claim("c 195:0"), POLICY)
        sweep = _in_a_new_pid_namespace("sweep()", tmp_path)
        assert sweep.returncode == 0 and sweep.stdout == "False\n", sweep.stderr  # left to the hooks
        listing = _in_a_new_pid_namespace("snapshot()", tmp_path)
        assert listing.returncode != 0
        assert "the ledger counts pids of another pid namespace" in listing.stderr, listing.stderr
        booking = json.loads((tmp_path / "ledger.json").read_text())["allocations"]["a"]
        assert booking["state"] == "active"
        with pytest.raises(LedgerError, match="held by container a"):
            Ledger(str(tmp_path)).book("b", os.getpid(), claim("c 195:0"), POLICY)


def test_a_health_file_in_a_directory_others_can_write_is_never_read(tmp_path: Path) -> None:
    """Anyone who could write the state dir could plant a health.json that passes a failing device (or one
    that takes every device out): the ledger refuses the directory before it reads anything in it."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "health.json").write_text(json.dumps({"unhealthy_nodes": []}))
    state.chmod(0o777)
    with pytest.raises(LedgerError, match=f"{state}: the state directory .*refused"):
        Ledger(str(state)).book("b", os.getpid(), claim("c 195:0"), POLICY)


def test_a_released_mig_instance_does_not_keep_its_whole_gpu_waiting_for_the_sweep(tmp_path: Path) -> None:
    """A MIG instance holds its GPU's node shared: a whole-GPU booking wants that node exclusive, and it used
    to leave the instance's release unfinished (it looked only at releases holding a node it wanted
    exclusive), so the whole GPU was refused until the node agent's sweep."""
    ledger = Ledger(str(tmp_path), reclaim_timeout=3600)
    instance = (Claim("vendor.com/gpu=0:1", ("c 195:0", "c 510:12"), shared=("c 195:0",)),)
    ledger.book("mig", os.getpid(), instance, POLICY)
    assert ledger.release("mig") == "released"
    assert ledger.book("whole", os.getpid(), claim("c 195:0"), POLICY).new
    assert "mig" not in ledger.snapshot()["allocations"]
