"""A DRA claim's booking and its own pod's containers: the pod is read from the container's cgroup (the
kubelet's, root-made), and a claim booking reserved for that pod is no clash with it, in either order; a
container of any other pod, or no pod, still clashes. Before, the claim clashed with its own pod: after a
ledger rebuild the driver could not book the claim again (its devices looked free once that container
ended), and the hook refused the pod's container the claim's devices."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.core.errors import LedgerError
from devinject.nodestate import podcgroup
from devinject.nodestate.ledger import Claim, Ledger, ledger_problem
from tests.e2e.conftest import UNLISTED_NODE, held_in_a_container, require, stand_ins

POLICY = {"vendor.com/gpu": "exclusive"}
POD = "8f0d3b4e-5a9c-4d3e-9f1a-2b7c6d5e4f3a"
OTHER_POD = "0c6e2f1a-7b3d-4e5f-8a9b-1c2d3e4f5a6b"
STATIC_POD = "6d5c4b3a29180716f5e4d3c2b1a09f8e"  # a static pod's UID: 32 hex digits
CTR = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"
NODE_ST = os.stat(UNLISTED_NODE)
NODE = f"c {os.major(NODE_ST.st_rdev)}:{os.minor(NODE_ST.st_rdev)}"
GPU = (Claim("vendor.com/gpu=0", (NODE,)),)
CLAIM = "dra-claim:dra.devinject.io:1111"


def v1(path: str, unified: str = "/") -> str:
    """/proc/<pid>/cgroup of a cgroup v1 (hybrid) host, every controller at `path`, as runc writes it."""
    controllers = ["cpu,cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls,net_prio", "blkio",
                   "perf_event", "hugetlb", "pids", "rdma", "misc"]
    lines = [f"{13 - n}:{c}:{path}" for n, c in enumerate(controllers)]
    return "\n".join([*lines, f"1:name=systemd:{path}", f"0::{unified}"]) + "\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


SYSTEMD_BURSTABLE = (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/"
                     f"cri-containerd-{CTR}.scope")


@pytest.mark.parametrize(("text", "uid"), [
    (v1(f"/kubepods/besteffort/pod{POD}/{CTR}"), POD),
    (v1(f"/kubepods/burstable/pod{POD}/{CTR}"), POD),
    (v1(f"/kubepods/pod{POD}/{CTR}"), POD),
    (v1(f"/kubepods/besteffort/pod{POD}"), POD),  # the pod's own cgroup (its sandbox's parent)
    (v1(SYSTEMD_BURSTABLE, unified=SYSTEMD_BURSTABLE), POD),
    (v1(f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CTR}.scope"), POD),
    (v2(f"/kubepods/besteffort/pod{POD}/{CTR}"), POD),
    (v2(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/"
        f"cri-containerd-{CTR}.scope"), POD),
    (v2(f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CTR}.scope"), POD),
    (v2(f"/kubepods/burstable/pod{STATIC_POD}/{CTR}"), STATIC_POD),
    (v2(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_POD}.slice"), STATIC_POD),
    # a container writing below its own cgroup (delegation, cgroupns) cannot name another pod
    (v2(f"/kubepods/besteffort/pod{POD}/{CTR}/kubepods/besteffort/pod{OTHER_POD}/x"), POD),
    # a process in the pod's own cgroup, no container's (both drivers, Guaranteed: no QoS level)
    (v2(f"/kubepods/pod{POD}"), POD),
    (v2(f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice"), POD),
    # a cgroup name may hold a colon: the line's third field is the rest of it
    (v2(f"/kubepods/besteffort/pod{POD}/ctr:with:colons"), POD),
], ids=["v1-cgroupfs-besteffort", "v1-cgroupfs-burstable", "v1-cgroupfs-guaranteed", "v1-pod-cgroup",
        "v1-systemd-burstable", "v1-systemd-guaranteed", "v2-cgroupfs", "v2-systemd-besteffort",
        "v2-systemd-guaranteed-crio", "v2-static-pod", "v2-systemd-static-pod", "v2-nested-below-a-pod",
        "v2-cgroupfs-pod-level", "v2-systemd-pod-level", "colon-in-a-name"])
def test_the_pod_of_a_kubelet_container_is_read_from_its_cgroup(text: str, uid: str) -> None:
    assert podcgroup.parse_pod_uid(text) == uid


@pytest.mark.parametrize("text", [
    v1("/"),
    v2("/system.slice/containerd.service"),
    v2("/user.slice/user-1000.slice/user@1000.service/app.slice"),
    # anything not the kubelet's tree from the root: a user's delegated subtree, a kubelet in a container
    v2(f"/user.slice/user-1000.slice/user@1000.service/kubepods/besteffort/pod{POD}/x"),
    v1(f"/docker/{CTR}/kubepods/besteffort/pod{POD}/{CTR}"),
    v2(f"/machine.slice/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice"),
    v2("/kubepods/besteffort"),  # the QoS level, no pod
    v2("/kubepods"),
    v2("/kubepods.slice/kubepods-besteffort.slice"),
    v2(f"/kubepods/besteffort/pod{POD[:-1]}/{CTR}"),  # not a UID
    v2(f"/kubepods/besteffort/pod{POD.upper()}/{CTR}"),
    v2(f"/kubepods/besteffort/podx{POD}/{CTR}"),
    v2(f"/kubepods/guaranteed/pod{POD}/{CTR}"),  # no such QoS level
    v2(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD}.slice"),  # systemd escapes -
    v2(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice"),
    v2(f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.scope"),
    # two pods at once: no pod
    f"4:devices:/kubepods/besteffort/pod{POD}/{CTR}\n3:memory:/kubepods/besteffort/pod{OTHER_POD}/{CTR}\n",
    "", "garbage\n",
    # read from a cgroup namespace of the reader's own (a pod on cgroup v2): relative, so no pod
    v2(f"/../../kubepods-besteffort-pod{POD.replace('-', '_')}.slice/cri-containerd-{CTR}.scope"),
    v2(f"/../../../kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice"),
], ids=["v1-root", "v2-system-service", "v2-user-session", "v2-user-delegated-kubepods", "v1-kubelet-in-docker",
        "v2-kubepods-slice-below-root", "qos-level", "kubepods-root", "systemd-qos-level", "short-uid", "upper-uid",
        "podx", "unknown-qos", "systemd-unescaped", "systemd-qos-mismatch", "systemd-scope", "two-pods",
        "empty", "garbage", "other-cgroupns-sibling", "other-cgroupns-root"])
def test_anything_else_is_no_pod(text: str) -> None:
    assert podcgroup.parse_pod_uid(text) is None


HIERARCHY = "devinject-test-pods"  # a named cgroup v1 hierarchy of the tests' own: no controller, no kubelet


@contextlib.contextmanager
def in_a_pod(pid: int, uid: str, layout: str = "cgroupfs", container: str = CTR) -> Iterator[None]:
    """Process `pid` in a pod's cgroup as the kubelet makes it, in a real cgroup hierarchy (a named v1 one of
    the test's own, which no kubelet or runtime touches): the kernel's own /proc/<pid>/cgroup text names it.
    Moved back out and removed however the test ends. Needs root."""
    require(os.geteuid() == 0, "needs root (a cgroup hierarchy)")
    mount_point = tempfile.mkdtemp(prefix="devinject-pods-")
    if os.system(f"mount -t cgroup -o none,name={HIERARCHY} cgroup {mount_point}") != 0:
        os.rmdir(mount_point)
        pytest.fail("cannot mount a named cgroup v1 hierarchy")
    if layout == "systemd":
        escaped = uid.replace("-", "_")
        parts = ["kubepods.slice", "kubepods-besteffort.slice", f"kubepods-besteffort-pod{escaped}.slice",
                 f"cri-containerd-{container}.scope"]
    else:
        parts = ["kubepods", "besteffort", f"pod{uid}", container]
    leaf = Path(mount_point, *parts)
    try:
        leaf.mkdir(parents=True)
        (leaf / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError):
            Path(mount_point, "cgroup.procs").write_text(str(pid))
        for depth in range(len(parts), 0, -1):
            with contextlib.suppress(OSError):
                Path(mount_point, *parts[:depth]).rmdir()
        os.system(f"umount {mount_point}")
        os.rmdir(mount_point)


@pytest.mark.parametrize("layout", ["cgroupfs", "systemd"])
def test_the_kernels_own_cgroup_file_names_the_pod(layout: str) -> None:
    with stand_ins(1) as (container,):
        assert podcgroup.pod_of(container.pid) is None
        with in_a_pod(container.pid, POD, layout):
            assert podcgroup.pod_of(container.pid) == POD
        assert podcgroup.pod_of(container.pid) is None
    assert podcgroup.pod_of(container.pid) is None  # gone


def test_a_claim_booked_first_lets_its_pods_container_book_its_device(tmp_path: Path) -> None:
    """The claim (held for the node, pid 1, reserved for POD), then the hook in POD's container asking for the
    claim's device (CRI-O with devinject's hook, an admin's annotation): booked. Another pod's container, and a
    process in no pod, are refused as before."""
    ledger = Ledger(str(tmp_path))
    ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD,))
    with stand_ins(3) as (mine, theirs, stranger), in_a_pod(mine.pid, POD), in_a_pod(theirs.pid, OTHER_POD):
        assert ledger.book("mine", mine.pid, GPU, POLICY).new
        with pytest.raises(LedgerError, match=f"device {NODE} is held by container {CLAIM}"):
            ledger.book("theirs", theirs.pid, GPU, POLICY)
        with pytest.raises(LedgerError, match=f"device {NODE} is held by container {CLAIM}"):
            ledger.book("stranger", stranger.pid, GPU, POLICY)
        allocations = ledger.snapshot()["allocations"]
        assert allocations["mine"]["pod"] == POD and allocations[CLAIM]["pods"] == [POD]
        assert sorted(allocations) == sorted([CLAIM, "mine"])


def test_a_claim_booked_after_its_pods_container_is_booked(tmp_path: Path) -> None:
    """The other way round (a claim booked again after a ledger lost it, while its pod's container holds the
    device): booked; a claim for another pod is refused."""
    ledger = Ledger(str(tmp_path))
    with stand_ins(1) as (mine,), in_a_pod(mine.pid, POD):
        ledger.book("mine", mine.pid, GPU, POLICY)
        with pytest.raises(LedgerError, match=f"device {NODE} is held by container mine"):
            ledger.book("dra-claim:dra.devinject.io:2222", 1, GPU, POLICY, for_pods=(OTHER_POD,))
        with pytest.raises(LedgerError, match=f"device {NODE} is held by container mine"):
            ledger.book("dra-claim:dra.devinject.io:3333", 1, GPU, POLICY, for_pods=())
        assert ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(OTHER_POD, POD)).new
        assert sorted(ledger.snapshot()["allocations"]) == sorted([CLAIM, "mine"])


def test_a_claim_is_booked_again_over_its_pods_recovered_container(tmp_path: Path) -> None:
    """A ledger rebuilt from live evidence (a corrupt file) books the claim's pod's running container (its
    device cgroup grants the GPU), with its pod: the driver's rebook of the claim then succeeds, a claim for
    another pod still clashes, and so does a process in no pod."""
    with held_in_a_container(UNLISTED_NODE) as container, in_a_pod(container, POD):
        (tmp_path / "ledger.json").write_text('{"allocations": {"c1": {"exclus')
        with pytest.raises(LedgerError, match="held by container recovered: "):
            Ledger(str(tmp_path)).book("dra-claim:dra.devinject.io:2222", 1, GPU, POLICY, for_pods=(OTHER_POD,))
        recovered = json.loads((tmp_path / "ledger.json").read_text())["allocations"]
        assert {e.get("pod") for e in recovered.values() if NODE in e["exclusive"]} == {POD}  # cgroup, open node
        assert Ledger(str(tmp_path)).book(CLAIM, 1, GPU, POLICY, for_pods=(POD,)).new
        with pytest.raises(LedgerError, match="held by container"):
            Ledger(str(tmp_path)).book("hook", os.getpid(), GPU, POLICY)


def test_the_pod_fields_are_validated() -> None:
    entry = {"devices": [], "exclusive": [NODE], "shared": [], "pid": 1, "start_time": 1, "state": "active"}
    assert ledger_problem({"allocations": {"a": {**entry, "pod": POD}, "b": {**entry, "pods": [POD]}}}) is None
    assert ledger_problem({"allocations": {"a": {**entry, "pod": [POD]}}}) == "allocation a: pod is not a string"
    assert ledger_problem({"allocations": {"a": {**entry, "pods": POD}}}) == \
        "allocation a: pods is not a list of strings"


def test_two_containers_of_a_pod_share_the_devices_its_claim_holds(tmp_path: Path) -> None:
    """Claims are the pod's: a main container and a sidecar referencing one claim both reach its device.
    Two containers of the pod on a device no claim of theirs holds still clash, and so does another pod."""
    ledger = Ledger(str(tmp_path))
    ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD,))
    other_gpu = (Claim("vendor.com/gpu=1", ("c 195:9",)),)
    with stand_ins(4) as (main, sidecar, third, theirs), in_a_pod(main.pid, POD, container="main"), \
            in_a_pod(sidecar.pid, POD, container="sidecar"), in_a_pod(third.pid, POD, container="third"), \
            in_a_pod(theirs.pid, OTHER_POD):
        assert ledger.book("main", main.pid, GPU + other_gpu, POLICY).new
        assert ledger.book("sidecar", sidecar.pid, GPU, POLICY).new
        with pytest.raises(LedgerError, match="device c 195:9 is held by container main"):
            ledger.book("third", third.pid, other_gpu, POLICY)
        with pytest.raises(LedgerError, match=f"device {NODE} is held by container"):
            ledger.book("theirs", theirs.pid, GPU, POLICY)


@pytest.mark.parametrize("content", [b"{not json", b'{"x": {"exclusive": "c 1:1"}}', b'{"x": {"devices": [], '
                                     b'"exclusive": [], "shared": [], "pid": 1, "start_time": 1, "state": "active"}}'])
def test_a_broken_claims_copy_is_left_out_of_a_rebuild(tmp_path: Path, content: bytes) -> None:
    """ledger-claims.json broken too (or holding what is no claim's booking): the rebuild goes on from live
    evidence alone and says so in the event log; the DRA driver's next round books its claims again."""
    ledger = Ledger(str(tmp_path))
    ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD,))
    assert json.loads((tmp_path / "ledger-claims.json").read_text())[CLAIM]["pods"] == [POD]
    (tmp_path / "ledger-claims.json").write_bytes(content)
    (tmp_path / "ledger.json").write_text('{"allocations": {"c1": {"exclus')
    assert CLAIM not in Ledger(str(tmp_path)).snapshot()["allocations"]
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (unreadable,) = [e for e in logged if e["event"] == "claims-unreadable"]
    assert unreadable["path"] == str(tmp_path / "ledger-claims.json")
    if content.startswith(b'{"'):  # JSON, but no claims' bookings
        assert unreadable["reason"] == "not the claims' bookings"
    else:  # the parser's own words
        assert "not the claims' bookings" not in unreadable["reason"] and unreadable["reason"]
    assert "ledger-rebuilt" in [e["event"] for e in logged]


def test_the_claims_copy_follows_the_claims(tmp_path: Path) -> None:
    """Written when a claim is booked or its booking ends, never for a container's booking."""
    ledger = Ledger(str(tmp_path))
    with stand_ins(1) as (container,):
        ledger.book("c1", container.pid, (Claim("vendor.com/gpu=1", ("c 195:9",)),), POLICY)
        assert not (tmp_path / "ledger-claims.json").exists()
        ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD,))
        assert list(json.loads((tmp_path / "ledger-claims.json").read_text())) == [CLAIM]
        ledger.release(CLAIM)
        ledger.sweep()
        assert json.loads((tmp_path / "ledger-claims.json").read_text()) == {}


def test_the_pods_of_a_shared_claim_share_its_devices(tmp_path: Path) -> None:
    """One claim reserved for two pods (a job's pods sharing an IMEX channel or a GPU): a container of each
    reaches the device; a container of a third pod is refused."""
    third_pod = "5d4c3b2a-1f0e-4d9c-8b7a-6f5e4d3c2b1a"
    ledger = Ledger(str(tmp_path))
    ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD, OTHER_POD))
    with stand_ins(3) as (mine, theirs, stranger), in_a_pod(mine.pid, POD), in_a_pod(theirs.pid, OTHER_POD), \
            in_a_pod(stranger.pid, third_pod):
        assert ledger.book("mine", mine.pid, GPU, POLICY).new
        assert ledger.book("theirs", theirs.pid, GPU, POLICY).new
        with pytest.raises(LedgerError, match=f"device {NODE} is held by container"):
            ledger.book("stranger", stranger.pid, GPU, POLICY)


def fake_process(proc: Path, pid: int, cgroup: bytes) -> None:
    """/proc/<pid> as the ledger reads it: `stat` (its start time, field 22) and `cgroup`."""
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (sleep) S " + " ".join(["0"] * 18) + " 4242 0 0\n")
    (proc / str(pid) / "cgroup").write_bytes(cgroup)


def test_a_booking_reads_its_pod_from_the_proc_it_is_given(tmp_path: Path) -> None:
    """No root and no cgroup needed: the ledger's `proc` is a tree. The pod is read from that tree's
    /proc/<pid>/cgroup (a line that is not UTF-8 is read past, not a crash), and it lets the container past
    its pod's claim; another pod's is refused."""
    proc = tmp_path / "proc"
    fake_process(proc, 1, b"0::/init.scope\n")
    fake_process(proc, 4100, b"5:name=\xff\xfe:/x\n0::/kubepods/besteffort/pod" + POD.encode() + b"/c1\n")
    fake_process(proc, 4200, b"0::/kubepods/besteffort/pod" + OTHER_POD.encode() + b"/c2\n")
    ledger = Ledger(str(tmp_path / "state"), proc=str(proc))
    ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD,))
    assert ledger.book("mine", 4100, GPU, POLICY).new
    with pytest.raises(LedgerError, match=f"device {NODE} is held by container {CLAIM}"):
        ledger.book("theirs", 4200, GPU, POLICY)
    assert json.loads((tmp_path / "state" / "ledger.json").read_text())["allocations"]["mine"]["pod"] == POD


def test_two_containers_of_a_pod_share_what_its_claim_holds_not_what_it_shares(tmp_path: Path) -> None:
    """A claim on a MIG instance holds the instance and shares the parent GPU's node with its siblings: two
    containers of its pod both taking the whole parent exclusively still clash."""
    proc = tmp_path / "proc"
    fake_process(proc, 1, b"0::/init.scope\n")
    for pid, name in ((4100, "c1"), (4101, "c2")):
        fake_process(proc, pid, b"0::/kubepods/besteffort/pod" + POD.encode() + b"/" + name.encode() + b"\n")
    ledger = Ledger(str(tmp_path / "state"), proc=str(proc))
    ledger.book(CLAIM, 1, (Claim("vendor.com/gpu=0:1", ("c 508:1", "c 195:0"), ("c 195:0",)),), POLICY,
                for_pods=(POD,))
    whole = (Claim("vendor.com/gpu=0", ("c 195:0",)),)
    assert ledger.book("c1-whole", 4100, whole, POLICY).new
    with pytest.raises(LedgerError, match="device c 195:0 is held by container c1-whole"):
        ledger.book("c2-whole", 4101, whole, POLICY)


def test_a_stale_claims_copy_is_made_good_by_the_next_write(tmp_path: Path) -> None:
    """The copy once failed to follow the ledger (a full /run): it held a claim the driver had released. A
    copy compared with what the ledger held before stayed stale, and a rebuild then brought the released
    claim back, a booking nobody would ever release. Compared with the file, the next write mends it."""
    proc = tmp_path / "proc"
    fake_process(proc, 1, b"0::/init.scope\n")
    fake_process(proc, 4100, b"0::/system.slice/x.service\n")
    ledger = Ledger(str(tmp_path / "state"), proc=str(proc))
    ledger.book(CLAIM, 1, GPU, POLICY, for_pods=(POD,))
    copy = tmp_path / "state" / "ledger-claims.json"
    stale = copy.read_bytes()
    ledger.release(CLAIM)
    ledger.sweep()
    assert json.loads(copy.read_text()) == {}
    copy.write_bytes(stale)  # as if that write had failed
    ledger.book("c1", 4100, (Claim("vendor.com/gpu=1", ("c 195:9",)),), POLICY)
    assert json.loads(copy.read_text()) == {}
    (tmp_path / "state" / "ledger.json").write_text('{"allocations": {"c1": {"exclus')
    assert CLAIM not in ledger.snapshot()["allocations"]


def test_containers_of_two_pods_riding_shares_of_one_gpu_do_not_clash(tmp_path: Path) -> None:
    """Consumable capacity: two claims each hold a share of one GPU, for two pods. The hook books each pod's
    container on the GPU's node (its claim's kind names no sharing, so exclusively): the second container
    clashed with the first, though both ride shares of that GPU. A container riding no share still clashes."""
    proc = tmp_path / "proc"
    fake_process(proc, 1, b"0::/init.scope\n")
    fake_process(proc, 4100, b"0::/kubepods/besteffort/pod" + POD.encode() + b"/c1\n")
    fake_process(proc, 4200, b"0::/kubepods/besteffort/pod" + OTHER_POD.encode() + b"/c2\n")
    fake_process(proc, 4300, b"0::/system.slice/other.scope\n")
    ledger = Ledger(str(tmp_path / "state"), proc=str(proc))
    gib = 2**30
    for claim, pod in ((CLAIM, POD), ("dra-claim:dra.devinject.io:2222", OTHER_POD)):
        ledger.book(claim, 1, GPU, POLICY, for_pods=(pod,),
                    consumes={NODE: {"memory": [16 * gib, 40 * gib], "shares": [1, 4]}})
    assert ledger.book("mine", 4100, GPU, POLICY).new
    assert ledger.book("theirs", 4200, GPU, POLICY).new
    with pytest.raises(LedgerError, match=f"device {NODE} is"):
        ledger.book("stranger", 4300, GPU, POLICY)
