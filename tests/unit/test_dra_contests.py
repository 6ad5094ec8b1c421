"""A device the device plugin holds, and a claim the scheduler allocated on it in the same instant (dra/driver.py
`contested_offers`, `contest_devices`, `contest_stands`): the device stays in the slice with a NoExecute taint
`<driver>/held-by-device-plugin` while such a claim points at it, so kube-controller-manager evicts the claim's
pod (its controller's next pod lands elsewhere) instead of it waiting in ContainerCreating; it leaves the
slice when no claim points at it. The driver before this left every held device out, contested or not."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from devinject.discovery.node import Node
from devinject.dra.claims import Contest
from devinject.dra.driver import HELD_CAUSE, PluginHolding, contest_stands, contested_devices, contested_offers
from devinject.dra.slices import DRIVER, NO_EXECUTE, NO_SCHEDULE, Offer, Taint, offers, resource_slices
from tests.conftest import HOSTS

LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
WHEN = "2026-12-01T20:00:00Z"
HOLDING = PluginHolding("nvidia.com/gpu", "the device plugin: nvidia.com/gpu device 0000:18:00.0, pod p1")


def _gpus() -> list[Offer]:
    return [o for o in offers(Node(str(HOSTS / "hgx-h100")), "node1") if o.kind == "nvidia.com/gpu"]


def _since(offer: Offer) -> Any:
    return lambda key: WHEN


def test_a_held_device_no_claim_points_at_leaves_the_slice() -> None:
    gpus = _gpus()
    held = {(gpus[0].pool, gpus[0].name): HOLDING}
    out = contested_offers(gpus, held, {}, DRIVER, _since)
    assert [o.name for o in out] == [o.name for o in gpus[1:]]
    assert all(not o.taints for o in out)


def test_a_held_device_a_claim_was_allocated_on_stays_tainted_no_execute() -> None:
    gpus = _gpus()
    key = (gpus[0].pool, gpus[0].name)
    out = contested_offers(gpus, {key: HOLDING}, {key: "default/web-abc-gpu"}, DRIVER, _since)
    assert [o.name for o in out] == [o.name for o in gpus]
    (kept,) = [o for o in out if o.name == gpus[0].name]
    assert kept.taints == (Taint(f"{DRIVER}/{HELD_CAUSE}", "nvidia.com-gpu", NO_EXECUTE, WHEN),)
    assert LABEL_VALUE.match(kept.taints[0].value)
    assert all(not o.taints for o in out if o.name != gpus[0].name)
    (device,) = [d for s in resource_slices(DRIVER, "node1", out) for d in s["spec"]["devices"]
                 if d["name"] == gpus[0].name]
    assert device["taints"] == [{"key": f"{DRIVER}/{HELD_CAUSE}", "value": "nvidia.com-gpu", "effect": NO_EXECUTE,
                                 "timeAdded": WHEN}]


def test_a_contested_device_keeps_its_fault_taints_beside_the_held_one() -> None:
    gpus = _gpus()
    xid = Taint(f"{DRIVER}/xid", "79", NO_SCHEDULE, WHEN)
    faulty = [replace(gpus[0], taints=(xid,)), *gpus[1:]]
    key = (gpus[0].pool, gpus[0].name)
    (kept, *_) = contested_offers(faulty, {key: HOLDING}, {key: "default/c"}, DRIVER, _since)
    assert [t.key for t in kept.taints] == [f"{DRIVER}/xid", f"{DRIVER}/{HELD_CAUSE}"]


def test_a_contest_on_a_device_the_plugin_does_not_hold_changes_nothing() -> None:
    gpus = _gpus()
    key = (gpus[0].pool, gpus[0].name)
    assert contested_offers(gpus, {}, {key: "default/c"}, DRIVER, _since) == gpus


def test_contested_devices_names_the_first_claim_of_each_device() -> None:
    contests = {"b-uid": Contest("default", "b", (("p", "gpu-1"), ("p", "gpu-2"))),
                "a-uid": Contest("ns", "a", (("p", "gpu-1"),))}
    assert contested_devices(contests) == {("p", "gpu-1"): "ns/a", ("p", "gpu-2"): "default/b"}
    assert contested_devices({}) == {}


def _claim(uid: str, devices: list[tuple[str, str]] | None) -> dict[str, Any]:
    claim: dict[str, Any] = {"metadata": {"name": "c", "namespace": "default", "uid": uid}, "status": {}}
    if devices is not None:
        claim["status"]["allocation"] = {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": p, "device": d} for p, d in devices]}}
    return claim


def test_a_contest_stands_while_the_claim_is_allocated_on_its_device() -> None:
    contest = Contest("default", "c", (("p", "gpu-1"),))
    assert contest_stands(_claim("u1", [("p", "gpu-1"), ("p", "gpu-5")]), "u1", DRIVER, contest)
    assert not contest_stands(None, "u1", DRIVER, contest)  # the API says it is gone (404)
    assert not contest_stands(_claim("u2", [("p", "gpu-1")]), "u1", DRIVER, contest)  # made again: another claim
    assert not contest_stands(_claim("u1", None), "u1", DRIVER, contest)  # deallocated
    assert not contest_stands(_claim("u1", [("p", "gpu-3")]), "u1", DRIVER, contest)  # allocated elsewhere
    other_driver = _claim("u1", [])
    other_driver["status"]["allocation"]["devices"]["results"] = [
        {"request": "gpu", "driver": "gpu.example.com", "pool": "p", "device": "gpu-1"}]
    assert not contest_stands(other_driver, "u1", DRIVER, contest)
