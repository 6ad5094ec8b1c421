"""Consumable capacity (DRAConsumableCapacity): dra/capacity.py's settings and the slice's shape, the
preparer's shares (a share ID in the CDI device and the ledger, the consumed amounts booked), and the
ledger's rule that shares meet only shares of their device and never sum beyond its capacity, across a
rebuild from the checkpoint."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.core.errors import LedgerError
from devinject.dra.capacity import CapacityError, CapacitySharing, consumed, parse_capacity_sharing, quantity
from devinject.dra.claims import PrepareError
from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Claim, Ledger
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver

GIB = 2**30
GPU = "gpu-0000-2a-00-0"  # /dev/nvidia3 of the HGX fixture
GPU_NODE = "c 195:3"
SHARE_A = "5b0c2f0e-aaaa-4c1b-9a55-00000000000a"
SHARE_B = "5b0c2f0e-bbbb-4c1b-9a55-00000000000b"
UID_A, UID_B, UID_C = (f"0b7f8e7c-3333-4c1b-9a55-00000000000{n}" for n in (1, 2, 3))
BOOKING_A = f"dra-claim:dra.devinject.io:{UID_A}"


def test_settings_are_parsed_and_bad_ones_named() -> None:
    assert parse_capacity_sharing("off") is None and parse_capacity_sharing("") is None
    assert parse_capacity_sharing("shares=4,memory=80Gi") == CapacitySharing(4, 80 * GIB)
    assert parse_capacity_sharing("shares=2,memory=auto") == CapacitySharing(2, None, True)
    assert parse_capacity_sharing("shares=8") == CapacitySharing(8)
    for bad, said in (("memory=80Gi", "shares=N is required"), ("shares=0", "from 1 to 1024"),
                      ("shares=four", "from 1 to 1024"), ("shares=2,memory=lots", "memory: expected a quantity"),
                      ("shares=2,colour=red", "expected shares=N"), ("shares=2,shares=3", "expected shares=N")):
        with pytest.raises(CapacityError, match=said):
            parse_capacity_sharing(bad)
    assert quantity("20Gi", "x") == 20 * GIB and quantity("4", "x") == 4 and quantity(1024, "x") == 1024
    for bad in ("1.5Gi", "-1", "20 Gi", True, None, "9" * 40):
        with pytest.raises(CapacityError):
            quantity(bad, "x")


def test_consumed_fills_defaults_and_refuses_what_the_device_lacks() -> None:
    capacity = {"memory": 80 * GIB, "shares": 4}
    assert consumed({"consumedCapacity": {"memory": "20Gi", "shares": "1"}}, capacity, "r") == \
        {"memory": 20 * GIB, "shares": 1}
    assert consumed({}, capacity, "r") == {"memory": 80 * GIB, "shares": 1}  # asked nothing: the whole memory
    with pytest.raises(CapacityError, match="consumedCapacity.colour: not a capacity"):
        consumed({"consumedCapacity": {"colour": "1"}}, capacity, "r")
    with pytest.raises(CapacityError, match="more than the device's"):
        consumed({"consumedCapacity": {"memory": "81Gi"}}, capacity, "r")


FOUR_SHARES = CapacitySharing(4, 40 * GIB)


def capacity_driver(dirs: dict[str, str], api: FakeApi, sharing: CapacitySharing | None = FOUR_SHARES) -> DraDriver:
    driver = make_driver(dirs, api)
    driver.opts = replace(driver.opts, capacity=sharing)
    return driver


def share(api: FakeApi, name: str, uid: str, shares: list[tuple[str, str]]) -> None:
    """A claim the scheduler allocated one share (shareID, memory) per entry of the GPU."""
    api.add(name, uid, [(GPU_POOL, GPU)] * len(shares))
    results = api.claims[("default", name)]["status"]["allocation"]["devices"]["results"]
    for result, (share_id, memory) in zip(results, shares, strict=False):
        result["shareID"] = share_id
        result["consumedCapacity"] = {"memory": memory, "shares": "1"}


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(out["state"], mode=0o755)
    return out


def test_the_slice_offers_whole_gpus_with_shareable_capacity(dirs: dict[str, str]) -> None:
    driver = capacity_driver(dirs, FakeApi())
    driver.discover()
    devices = {d["name"]: d for s in driver.desired() for d in s["spec"].get("devices", [])}
    gpu = devices[GPU]
    assert gpu["allowMultipleAllocations"] is True
    assert gpu["capacity"] == {
        "memory": {"value": "40Gi", "requestPolicy": {"default": "40Gi",
                                                         "validRange": {"min": "1Mi", "step": "1Mi"}}},
        "shares": {"value": "4", "requestPolicy": {"default": "1",
                                                   "validRange": {"min": "1", "max": "4", "step": "1"}}}}
    # a MIG instance, its parent, a NIC keep no allowMultipleAllocations... only whole unsplit devices do
    assert not any(d.get("allowMultipleAllocations") for d in devices.values() if "-gi" in d["name"])
    plain = make_driver(dirs, FakeApi())
    plain.discover()
    assert not any(d.get("allowMultipleAllocations") for s in plain.desired() for d in s["spec"].get("devices", []))


def test_two_claims_share_a_gpu_and_a_third_beyond_its_memory_is_refused(dirs: dict[str, str]) -> None:
    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "20Gi")])
    share(api, "b", UID_B, [(SHARE_B, "16Gi")])
    share(api, "c", UID_C, [("5b0c2f0e-cccc-4c1b-9a55-00000000000c", "8Gi")])  # a stale scheduler's view
    driver = capacity_driver(dirs, api)
    a = driver.preparer.prepare("default", "a", UID_A)
    b = driver.preparer.prepare("default", "b", UID_B)
    assert [d.share_id for d in a] == [SHARE_A] and a[0].cdi_ids == (f"dra.devinject.io/claim={UID_A}-{GPU}-{SHARE_A}",)
    assert [d.share_id for d in b] == [SHARE_B]
    allocations = Ledger(dirs["state"]).snapshot()["allocations"]
    assert allocations[BOOKING_A]["consumes"] == {GPU_NODE: {"memory": [20 * GIB, 40 * GIB], "shares": [1, 4]}}
    assert allocations[BOOKING_A]["devices"] == [f"nvidia.com/gpu={GPU}@{SHARE_A}"]
    with pytest.raises(PrepareError, match=r"memory 8589934592 asked, 4294967296 of 42949672960 left"):
        driver.preparer.prepare("default", "c", UID_C)
    assert not os.path.exists(driver.preparer.spec_path(UID_C))  # nothing left of it
    driver.preparer.unprepare(UID_B)
    assert driver.preparer.prepare("default", "c", UID_C)  # room again


def test_a_share_never_meets_an_exclusive_holder_either_way(dirs: dict[str, str]) -> None:
    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "20Gi")])
    api.add("whole", UID_B, [(GPU_POOL, GPU)])  # no shareID: the claim's alone
    driver = capacity_driver(dirs, api)
    driver.preparer.prepare("default", "a", UID_A)
    with pytest.raises(PrepareError, match=f"device {GPU_NODE} is held by container {BOOKING_A}"):
        driver.preparer.prepare("default", "whole", UID_B)
    with pytest.raises(LedgerError, match="is shared by consumable capacity"):  # a time-sliced container, say
        Ledger(dirs["state"]).book("c1", os.getpid(), (Claim("nvidia.com/gpu=3", (), (GPU_NODE,)),))
    driver.preparer.unprepare(UID_A)
    driver.preparer.prepare("default", "whole", UID_B)
    with pytest.raises(PrepareError, match="is held by"):
        driver.preparer.prepare("default", "a", UID_A)


def test_two_shares_of_one_claim_are_two_cdi_devices_and_add_up(dirs: dict[str, str]) -> None:
    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "10Gi"), (SHARE_B, "12Gi")])
    driver = capacity_driver(dirs, api)
    prepared = driver.preparer.prepare("default", "a", UID_A)
    assert len({d.cdi_ids for d in prepared}) == 2
    assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING_A]["consumes"][GPU_NODE]["memory"] == \
        [22 * GIB, 40 * GIB]


def test_a_share_on_a_node_that_offers_none_is_refused(dirs: dict[str, str]) -> None:
    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "10Gi")])
    driver = capacity_driver(dirs, api, None)
    with pytest.raises(PrepareError, match="does not offer it by consumable capacity"):
        driver.preparer.prepare("default", "a", UID_A)
    api.claims[("default", "a")]["status"]["allocation"]["devices"]["results"][0]["shareID"] = "../../etc"
    with pytest.raises(PrepareError, match="shareID: '../../etc' is not a UID"):
        capacity_driver(dirs, api).preparer.prepare("default", "a", UID_A)


def test_the_shares_survive_a_lost_ledger(dirs: dict[str, str]) -> None:
    """Ledger and its claims' copy lost: rebuilt from the checkpoint, the shares' amounts are counted again,
    so a claim beyond the memory left is still refused, and the driver's round books them without refusal."""
    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "30Gi")])
    share(api, "b", UID_B, [(SHARE_B, "16Gi")])
    driver = capacity_driver(dirs, api)
    driver.preparer.prepare("default", "a", UID_A)
    Path(dirs["state"], "ledger.json").write_text('{"allocations": {"c1": {"exclus')
    Path(dirs["state"], "ledger-claims.json").unlink()
    assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING_A]["consumes"][GPU_NODE]["memory"][0] == 30 * GIB
    assert driver.preparer.rebook() == 0
    with pytest.raises(PrepareError, match="memory .* asked"):
        driver.preparer.prepare("default", "b", UID_B)


def test_a_corrupt_consumes_record_is_a_broken_ledger(dirs: dict[str, str]) -> None:
    from devinject.nodestate.ledger import ledger_problem

    entry = {"devices": [], "exclusive": [], "shared": [GPU_NODE], "pid": 1, "start_time": 1, "state": "active"}
    assert ledger_problem({"allocations": {"x": {**entry, "consumes": {GPU_NODE: {"memory": [1, 2]}}}}}) is None
    for bad in ({GPU_NODE: {"memory": ["1", 2]}}, {GPU_NODE: {"memory": [3, 2]}}, {GPU_NODE: []}, "all"):
        assert ledger_problem({"allocations": {"x": {**entry, "consumes": bad}}}) is not None


def test_the_kubelet_is_told_each_share_id(dirs: dict[str, str]) -> None:
    """NodePrepareResources answers a share's device with its `share_id` (the kubelet keys a shared device's
    allocation by driver, pool, device and share), and an unshared one without it."""
    from tests.integration.test_dra_driver import prepare

    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "10Gi")])
    api.add("whole", UID_B, [(GPU_POOL, "gpu-0000-18-00-0")])
    driver = capacity_driver(dirs, api)
    driver.start()
    try:
        answer = prepare(driver, ("a", UID_A), ("whole", UID_B))
    finally:
        driver.servers.stop()
    assert [(d.share_id, d.HasField("share_id")) for d in answer.claims[UID_A].devices] == [(SHARE_A, True)]
    assert [d.HasField("share_id") for d in answer.claims[UID_B].devices] == [False]


def test_a_gpus_shares_are_all_mps_clients_or_none(dirs: dict[str, str]) -> None:
    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "10Gi")])
    share(api, "b", UID_B, [(SHARE_B, "10Gi")])
    api.claims[("default", "b")]["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": "dra.devinject.io", "parameters": {
            "apiVersion": "dra.devinject.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}}}]
    driver = capacity_driver(dirs, api)
    driver.preparer.prepare("default", "a", UID_A)
    with pytest.raises(PrepareError, match=f"{GPU} is shared with claim default/a, not an MPS client"):
        driver.preparer.prepare("default", "b", UID_B)
    assert not os.path.exists(driver.preparer.spec_path(UID_B))
