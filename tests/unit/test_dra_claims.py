"""dra/claims.py and the pods a claim is reserved for: the claim's booking carries them (ledger and
checkpoint), so the driver books a claim again over its own pod's running container after a ledger rebuilt
from live evidence (issue 21: it was refused, "its devices are not in the ledger", and once that container
ended the claim's GPU looked free to the hook); a checkpoint written before pods were recorded still loads,
and its claim learns them from the API server when its booking is refused."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.core.errors import LedgerError
from devinject.dra.claims import Checkpoint, CheckpointError, reserved_pods
from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Claim, Ledger
from tests.e2e.conftest import stand_ins
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver
from tests.unit.test_dra_checkpoint_records import checksummed
from tests.unit.test_ledger_pods import OTHER_POD, POD, in_a_pod

UID = "0b7f8e7c-2222-4c1b-9a55-000000000001"
GPU_NODE = "c 195:3"  # /dev/nvidia3, the GPU at 0000:2a:00.0 of the HGX fixture
BOOKING = f"dra-claim:dra.devinject.io:{UID}"


def consumer(uid: str, resource: str = "pods", api_group: str | None = None) -> dict[str, str]:
    ref = {"resource": resource, "name": f"n-{uid[:4]}", "uid": uid}
    if api_group is not None:
        ref["apiGroup"] = api_group
    return ref


def test_reserved_pods_are_the_pod_consumers_of_the_claim() -> None:
    claim = {"status": {"reservedFor": [consumer(POD), consumer(OTHER_POD, api_group=""), consumer(POD),
                                        consumer("x", resource="deployments", api_group="apps"),
                                        consumer("y", api_group="example.com"), {"resource": "pods", "uid": ""},
                                        "garbage"]}}
    assert reserved_pods(claim) == tuple(sorted((POD, OTHER_POD)))
    assert reserved_pods({"status": {}}) == () and reserved_pods({}) == ()
    assert reserved_pods({"status": {"reservedFor": "pods"}}) == ()


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(out["state"], mode=0o755)
    return out


@pytest.fixture
def driver(dirs: dict[str, str]) -> Iterator[DraDriver]:
    """The driver (no sockets: the claims are prepared through its Preparer) over the HGX fixture, with one
    claim for the GPU at 0000:2a:00.0 reserved for POD."""
    api = FakeApi()
    api.add("held", UID, [(GPU_POOL, "gpu-0000-2a-00-0")])
    api.claims[("default", "held")]["status"]["reservedFor"] = [consumer(POD)]
    yield make_driver(dirs, api)


@contextlib.contextmanager
def pod_container(v1_device_cgroup: Path, pod: str) -> Iterator[int]:
    """A running container of `pod` as the kubelet and runc make one: in the pod's cgroup, and in a device
    cgroup that grants the claimed GPU's node by name (what a ledger rebuild finds). Its pid."""
    with stand_ins(1) as (container,), in_a_pod(container.pid, pod):
        (v1_device_cgroup / "cgroup.procs").write_text(str(container.pid))
        (v1_device_cgroup / "devices.deny").write_text("a")
        (v1_device_cgroup / "devices.allow").write_text(f"{GPU_NODE} rw")
        yield container.pid


def corrupt_ledger(dirs: dict[str, str], *, claims_too: bool = True) -> None:
    """The ledger broken; `claims_too`: the claims' own copy (ledger-claims.json) lost as well, so the rebuild
    cannot keep the claim and the driver's round must book it again."""
    Path(dirs["state"], "ledger.json").write_text('{"allocations": {"c1": {"exclus')
    if claims_too:
        Path(dirs["state"], "ledger-claims.json").unlink()


def test_a_rebuild_keeps_the_claims_bookings(driver: DraDriver, dirs: dict[str, str],
                                             v1_device_cgroup: Path) -> None:
    """No process shows a claim's devices in use (a claim is booked for pid 1): the rebuild took them from
    live evidence alone, so until the driver's next round (up to a rescan later) the claim's GPU was free to
    anyone. Kept beside the ledger, they are in the rebuilt ledger at once, with the pod's container."""
    driver.preparer.prepare("default", "held", UID)
    with pod_container(v1_device_cgroup, POD):
        corrupt_ledger(dirs, claims_too=False)
        allocations = Ledger(dirs["state"]).snapshot()["allocations"]
        assert allocations[BOOKING]["pods"] == [POD]
        assert [e.get("pod") for n, e in allocations.items() if n != BOOKING and GPU_NODE in e["exclusive"]] \
            == [POD]
    # the pod's container gone: the claim alone holds the GPU, no driver round in between
    with pytest.raises(LedgerError, match=f"device {GPU_NODE} is held by container {BOOKING}"):
        Ledger(dirs["state"]).book("intruder", os.getpid(), (Claim("nvidia.com/gpu=1", (GPU_NODE,)),))
    assert driver.preparer.rebook() == 0


def test_a_prepared_claim_books_and_checkpoints_its_pods(driver: DraDriver, dirs: dict[str, str]) -> None:
    driver.preparer.prepare("default", "held", UID)
    assert driver.preparer.prepared()[UID].pods == (POD,)
    assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING]["pods"] == [POD]


def test_the_claim_is_booked_again_over_its_pods_recovered_container(driver: DraDriver, dirs: dict[str, str],
                                                                     v1_device_cgroup: Path) -> None:
    """Prepared; the ledger and the claims' copy lost; the next access rebuilds it and books the pod's running
    container and the claim (from the driver's checkpoint); the driver's round finds it booked (no refusal),
    and a process in no pod is refused the GPU by the claim once the pod's container is gone."""
    driver.preparer.prepare("default", "held", UID)
    with pod_container(v1_device_cgroup, POD):
        corrupt_ledger(dirs)
        allocations = Ledger(dirs["state"]).snapshot()["allocations"]  # rebuilt: the claim from its checkpoint
        assert allocations[BOOKING]["pods"] == [POD]
        assert [e.get("pod") for n, e in allocations.items() if n != BOOKING and GPU_NODE in e["exclusive"]] \
            == [POD]
        assert driver.preparer.rebook() == 0
        assert BOOKING in Ledger(dirs["state"]).snapshot()["allocations"]
    with pytest.raises(LedgerError, match=f"device {GPU_NODE} is held by container {BOOKING}"):
        Ledger(dirs["state"]).book("intruder", os.getpid(), (Claim("nvidia.com/gpu=1", (GPU_NODE,)),))


def test_a_container_of_another_pod_still_keeps_the_claim_out(driver: DraDriver, dirs: dict[str, str],
                                                              v1_device_cgroup: Path) -> None:
    driver.preparer.prepare("default", "held", UID)
    with pod_container(v1_device_cgroup, OTHER_POD):
        corrupt_ledger(dirs)
        assert driver.preparer.rebook() == 1
        assert BOOKING not in Ledger(dirs["state"]).snapshot()["allocations"]


def test_a_checkpoint_without_pods_loads_and_learns_them_from_the_api(driver: DraDriver, dirs: dict[str, str],
                                                                      v1_device_cgroup: Path) -> None:
    """A checkpoint written before claims recorded their pods: it loads, and the claim refused over its pod's
    recovered container is read again from the API server and booked with the pods it is reserved for."""
    driver.preparer.prepare("default", "held", UID)
    path = Path(dirs["state"], "dra-dra.devinject.io.checkpoint.json")
    old = json.loads(path.read_text())
    del old["claims"][UID]["pods"]
    path.write_text(json.dumps({"version": 1, "claims": old["claims"]}))  # as written before checksums
    assert "pods" not in Checkpoint(str(path)).load()[UID]
    with pod_container(v1_device_cgroup, POD):
        corrupt_ledger(dirs)
        assert driver.preparer.rebook() == 0
        assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING]["pods"] == [POD]
        assert driver.preparer.prepared()[UID].pods == (POD,)


def test_a_checkpoint_whose_pods_are_not_uids_is_corrupt(driver: DraDriver, dirs: dict[str, str]) -> None:
    driver.preparer.prepare("default", "held", UID)
    path = Path(dirs["state"], "dra-dra.devinject.io.checkpoint.json")
    data = json.loads(path.read_text())
    data["claims"][UID]["pods"] = POD
    path.write_bytes(checksummed(data["claims"]))  # checksummed: the claim's own check refuses it
    with pytest.raises(CheckpointError, match=f"claim {UID}: pods is not a list of pod UIDs"):
        Checkpoint(str(path)).load()


def test_a_claim_checkpointed_without_pods_learns_them_though_the_ledger_holds_it(driver: DraDriver,
                                                                                   dirs: dict[str, str]) -> None:
    """An upgrade: the checkpoint and the ledger's booking from before claims recorded their pods, nothing
    refused (the ledger holds the claim), so the driver's round never asked the API server and the pod's own
    containers stayed refused by their claim. Now the round asks once, and books and checkpoints the pods."""
    driver.preparer.prepare("default", "held", UID)
    path = Path(dirs["state"], "dra-dra.devinject.io.checkpoint.json")
    old = json.loads(path.read_text())
    del old["claims"][UID]["pods"]
    path.write_text(json.dumps({"version": 1, "claims": old["claims"]}))  # as written before checksums
    ledger_path = Path(dirs["state"], "ledger.json")
    ledger = json.loads(ledger_path.read_text())
    del ledger["allocations"][BOOKING]["pods"]
    ledger_path.write_text(json.dumps(ledger))
    asked: list[str] = []
    real = driver.preparer.get_claim
    driver.preparer.get_claim = lambda namespace, name: asked.append(name) or real(namespace, name)  # type: ignore[method-assign]
    assert driver.preparer.rebook() == 0
    assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING]["pods"] == [POD]
    assert driver.preparer.prepared()[UID].pods == (POD,)
    assert driver.preparer.rebook() == 0
    assert asked == ["held"]  # once: the checkpoint has them now


def test_a_rebuild_with_both_ledger_files_lost_books_the_checkpointed_claim(driver: DraDriver,
                                                                            dirs: dict[str, str]) -> None:
    """The claim prepared, its pod not started yet, ledger.json and ledger-claims.json both corrupt: the
    rebuild saw no claim, and a process in no pod booked the claim's GPU while the claim's spec stayed for the
    runtime to apply (one GPU, two holders). The rebuild reads the DRA driver's checkpoint too."""
    driver.preparer.prepare("default", "held", UID)
    corrupt_ledger(dirs)
    Path(dirs["state"], "ledger-claims.json").write_text("{broken")
    with pytest.raises(LedgerError, match=f"device {GPU_NODE} is held by container {BOOKING}"):
        Ledger(dirs["state"]).book("intruder", os.getpid(), (Claim("nvidia.com/gpu=1", (GPU_NODE,)),))
    allocations = Ledger(dirs["state"]).snapshot()["allocations"]
    assert allocations[BOOKING]["pods"] == [POD] and allocations[BOOKING]["exclusive"] == [GPU_NODE]
    assert driver.preparer.rebook() == 0  # already held as the driver books it
    driver.preparer.unprepare(UID)
    assert BOOKING not in Ledger(dirs["state"]).snapshot()["allocations"]


def test_an_unreadable_checkpoint_is_said_in_the_rebuild(driver: DraDriver, dirs: dict[str, str]) -> None:
    driver.preparer.prepare("default", "held", UID)
    Path(dirs["state"], "dra-dra.devinject.io.checkpoint.json").write_text("{")
    corrupt_ledger(dirs)
    Ledger(dirs["state"]).snapshot()
    assert "checkpoint-unreadable" in Path(dirs["state"], "events.jsonl").read_text()
