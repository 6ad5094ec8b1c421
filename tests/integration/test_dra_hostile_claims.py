"""A pod user's claim against the DRA driver over its real gRPC socket (issue 40, items 4 and 7): whatever one
claim holds, it fails alone, in one line, and the other claims of the same NodePrepareResources are prepared
and answered; consumable-capacity amounts below the published minimum are refused, so zero-sized shares
cannot pile onto a full GPU."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devinject.core.errors import LedgerError
from devinject.dra.capacity import CapacityError, consumed
from devinject.dra.claims import PrepareError
from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Claim, Ledger
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, FakeApi, make_driver, prepare, unprepare
from tests.unit.test_dra_capacity import GPU, GPU_NODE, capacity_driver, share

UID_GOOD = "0b7f8e7c-4444-4c1b-9a55-000000000001"
UID_BAD = "0b7f8e7c-4444-4c1b-9a55-000000000002"


def mps_config(per_device: dict[str, str]) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": per_device}}}}}]


def claim_dirs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "state").mkdir(mode=0o755)
    return {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[DraDriver, FakeApi]]:
    api = FakeApi()
    driver = make_driver(claim_dirs(tmp_path), api)
    driver.start()
    try:
        yield driver, api
    finally:
        driver.servers.stop()


def test_a_unicode_digit_in_a_claims_config_fails_that_claim_alone(served: tuple[DraDriver, FakeApi]) -> None:
    """'²' passed isdigit() and failed int(): the ValueError escaped, the whole call answered UNKNOWN, and the
    good claim, listed after it, was never prepared (before it: prepared on the node, its answer lost)."""
    driver, api = served
    api.add("bad", UID_BAD, [(GPU_POOL, "gpu-0000-18-00-0")], config=mps_config({"²": "1Gi"}))
    api.add("good", UID_GOOD, [(GPU_POOL, "gpu-0000-5d-00-0")])
    answer = prepare(driver, ("bad", UID_BAD), ("good", UID_GOOD)).claims
    assert answer[UID_GOOD].error == "" and [d.device_name for d in answer[UID_GOOD].devices] == ["gpu-0000-5d-00-0"]
    assert answer[UID_BAD].error == (
        "claim default/bad: status.allocation.devices.config[0].opaque: sharing.mpsConfig."
        "defaultPerDevicePinnedMemoryLimit.'²': expected a device index in the claim (0, 1, ...)")
    assert not answer[UID_BAD].devices
    assert set(driver.preparer.prepared()) == {UID_GOOD}
    undone = unprepare(driver, ("bad", UID_BAD), ("good", UID_GOOD)).claims
    assert (undone[UID_BAD].error, undone[UID_GOOD].error) == ("", "")


def test_any_error_in_one_claims_prepare_or_unprepare_is_that_claims(served: tuple[DraDriver, FakeApi],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The class, not the one parser: an error devinject did not expect (a bug) is still one claim's line."""
    driver, api = served
    api.add("good", UID_GOOD, [(GPU_POOL, "gpu-0000-5d-00-0")])
    api.add("bad", UID_BAD, [(GPU_POOL, "gpu-0000-18-00-0")])
    real_prepare, real_unprepare = driver.preparer.prepare, driver.preparer.unprepare

    def failing_prepare(namespace: str, name: str, uid: str) -> Any:
        if uid == UID_BAD:
            raise KeyError("a\nmultiline key")
        return real_prepare(namespace, name, uid)

    def failing_unprepare(uid: str) -> None:
        if uid == UID_BAD:
            raise ValueError("invalid literal for int() with base 10: '²'")
        real_unprepare(uid)

    monkeypatch.setattr(driver.preparer, "prepare", failing_prepare)
    monkeypatch.setattr(driver.preparer, "unprepare", failing_unprepare)
    answer = prepare(driver, ("bad", UID_BAD), ("good", UID_GOOD)).claims
    assert answer[UID_GOOD].error == "" and len(answer[UID_GOOD].devices) == 1
    assert answer[UID_BAD].error == ("internal error in devinject's prepare: KeyError: 'a\\nmultiline key' (a bug: "
                                     "the driver's log has its traceback)")
    undone = unprepare(driver, ("bad", UID_BAD), ("good", UID_GOOD)).claims
    assert undone[UID_GOOD].error == "" and driver.preparer.prepared() == {}
    assert undone[UID_BAD].error.startswith("internal error in devinject's unprepare: ValueError: invalid literal")
    assert "Traceback" in caplog.text or any(r.exc_info for r in caplog.records)


def test_a_claim_that_fails_unexpectedly_after_its_booking_leaves_nothing(served: tuple[DraDriver, FakeApi],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug after the booking (here in the checkpoint's step) left the GPU booked and its spec written for a
    claim the kubelet was told failed: no other claim could have the GPU until a restart."""
    driver, api = served
    api.add("bad", UID_BAD, [(GPU_POOL, "gpu-0000-18-00-0")])

    def broken(*args: object) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(driver.preparer.checkpoint, "save", broken)
    answer = prepare(driver, ("bad", UID_BAD)).claims[UID_BAD]
    assert answer.error.startswith("internal error in devinject's prepare: IndexError") and not answer.devices
    assert UID_BAD not in json.dumps(Ledger(driver.opts.state_dir).snapshot())
    assert not os.path.exists(driver.preparer.spec_path(UID_BAD))
    monkeypatch.undo()
    api.add("next", UID_GOOD, [(GPU_POOL, "gpu-0000-18-00-0")])  # the same GPU: free again
    assert prepare(driver, ("next", UID_GOOD)).claims[UID_GOOD].error == ""


# --- consumable capacity: amounts below the published minimum ---------------------------------------------


def shares_of(api: FakeApi, name: str, uid: str, share_uid: str, memory: str, shares: str) -> None:
    share(api, name, uid, [(share_uid, memory)])
    api.claims[("default", name)]["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {
        "memory": memory, "shares": shares}


def test_zero_sized_shares_cannot_pile_onto_a_full_gpu(tmp_path: Path) -> None:
    """The attack: a GPU of 4 shares holding 3; ten more claims of 0 shares (1Gi each) were all booked."""
    api = FakeApi()
    for n in range(3):
        shares_of(api, f"held{n}", f"0b7f8e7c-5555-4c1b-9a55-00000000000{n}",
                  f"5b0c2f0e-5555-4c1b-9a55-00000000000{n}", "10Gi", "1")
    for n in range(10):
        shares_of(api, f"zero{n}", f"0b7f8e7c-6666-4c1b-9a55-0000000000{n:02}",
                  f"5b0c2f0e-6666-4c1b-9a55-0000000000{n:02}", "1Gi", "0")
    shares_of(api, "nomemory", "0b7f8e7c-7777-4c1b-9a55-000000000001", "5b0c2f0e-7777-4c1b-9a55-000000000001",
              "0", "1")
    dirs = claim_dirs(tmp_path)
    driver = capacity_driver(dirs, api)
    for n in range(3):
        driver.preparer.prepare("default", f"held{n}", f"0b7f8e7c-5555-4c1b-9a55-00000000000{n}")
    for n in range(10):
        with pytest.raises(PrepareError, match=r"consumedCapacity.shares: 0 is less than the device's minimum 1"):
            driver.preparer.prepare("default", f"zero{n}", f"0b7f8e7c-6666-4c1b-9a55-0000000000{n:02}")
    with pytest.raises(PrepareError, match=r"consumedCapacity.memory: 0 is less than the device's minimum 1048576"):
        driver.preparer.prepare("default", "nomemory", "0b7f8e7c-7777-4c1b-9a55-000000000001")
    booked = Ledger(dirs["state"]).snapshot()["allocations"]
    assert sum(GPU_NODE in (e.get("consumes") or {}) for e in booked.values()) == 3
    assert sorted(os.listdir(dirs["cdi"])) == sorted(os.path.basename(driver.preparer.spec_path(
        f"0b7f8e7c-5555-4c1b-9a55-00000000000{n}")) for n in range(3))
    assert json.dumps(booked).count(GPU) == 3


def test_consumed_refuses_amounts_below_the_minimum_and_the_ledger_refuses_none() -> None:
    capacity = {"memory": 40 * 2**30, "shares": 4}
    for said, message in (({"memory": "0"}, "memory: 0 is less"), ({"memory": "512Ki"}, "memory: 524288 is less"),
                          ({"memory": "1Gi", "shares": "0"}, "shares: 0 is less")):
        with pytest.raises(CapacityError, match=message):
            consumed({"consumedCapacity": said}, capacity, "r")
    assert consumed({"consumedCapacity": {"memory": "1Mi"}}, capacity, "r") == {"memory": 2**20, "shares": 1}


@pytest.mark.parametrize("amount", [0, -1])
def test_the_ledger_books_no_share_of_nothing(tmp_path: Path, amount: int) -> None:
    """The node's word whatever the scheduler believed: a share of 0 (or less) never fills the device."""
    with pytest.raises(LedgerError, match=rf"device {GPU_NODE}: a shares share of {amount} \(of 4\) cannot be booked"):
        Ledger(str(tmp_path)).book("dra-claim:x", 1, (Claim(f"nvidia.com/gpu={GPU}@s", (GPU_NODE,), ()),),
                                   {"nvidia.com/gpu": "exclusive"}, for_pods=(),
                                   consumes={GPU_NODE: {"shares": [amount, 4]}})
    assert not (tmp_path / "ledger.json").exists() or "dra-claim:x" not in (tmp_path / "ledger.json").read_text()
