"""Faults as device taints: each reason the health checks write names its cause (agent/health.py
`faults_of`), a verdict becomes `<driver>/<cause>` taints with the detail as value and the effect the admin
chose for fatal faults (dra/driver.py `taints_for`), and a pool with a tainted device is cut in slices of at
most 64 devices (dra/slices.py), as resource.k8s.io/v1 validation requires. Each fails on the driver before
taints (no `faults_of`, no `Taint`, 128-device slices whatever the taints)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devinject.agent.health import Fault, check_host, faults_of, unbound_verdict
from devinject.discovery.node import Node
from devinject.dra.driver import NodeHealth, fault_reasons, taints_for
from devinject.dra.publisher import _content, keep_taint_times
from devinject.dra.slices import (
    DRIVER,
    MAX_DEVICES,
    MAX_DEVICES_WITH_COUNTERS,
    NO_EXECUTE,
    NO_SCHEDULE,
    Taint,
    label_value,
    offers,
    resource_slices,
)
from tests.conftest import HOSTS

GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
KEY = "nvidia.com/gpu=0000:18:00.0"
LABEL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    if path.is_symlink() or path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(("fault", "expected"), [
    (lambda r: _write(r, "var/log/kern.log", "kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off "
                                             "the bus.\n"), Fault("xid", "79", fatal=True)),
    (lambda r: _write(r, f"{GPU}/aer_dev_fatal", "TOTAL_ERR_FATAL 2\n"), Fault("aer-fatal", "2", fatal=True)),
    (lambda r: _write(r, f"{GPU}/aer_dev_nonfatal", "TOTAL_ERR_NONFATAL 1\n"), Fault("aer-nonfatal", "1")),
    (lambda r: (r / GPU / "driver").unlink(), Fault("unbound")),
    (lambda r: _write(r, f"{GPU}/enable", "0\n"), Fault("disabled")),
    (lambda r: _write(r, f"{GPU}/current_link_width", "8\n"), Fault("link", "x8-of-x16")),
    (lambda r: _write(r, "proc/driver/nvidia/gpus/0000:18:00.0/information", "Device Minor: \t 2\n"
                      "GPU Excluded:\t Yes\n"), Fault("driver-verdict")),
], ids=["xid", "aer-fatal", "aer-nonfatal", "unbound", "disabled", "link", "driver-verdict"])
def test_each_reason_the_checks_write_names_its_cause(host_copy: Any, fault: Any, expected: Fault) -> None:
    """The reasons as the health checks themselves write them (not copies of their text)."""
    root = host_copy("hgx-h100")
    fault(root)
    (verdict,) = [v for v in check_host(Node(str(root))) if v.key == KEY]
    assert faults_of(verdict.reasons) == [expected]


def test_the_other_producers_reasons() -> None:
    gone = "0000:18:00.0: gone from the PCI bus"
    assert faults_of([gone, "0000:18:00.0: no longer present"]) == [Fault("gone", fatal=True)]  # one per cause
    assert faults_of(["probe timed out after 2s"]) == [Fault("probe-timeout")]
    assert faults_of(["health state not trusted (x): out until its checks pass"]) == [Fault("unverified")]
    assert faults_of(["/dev/nvidia-caps-imex-channels/channel1: no such node"]) == [Fault("gone", fatal=True)]
    assert faults_of(["/dev/x: is c 1:3, not c 233:1"]) == [Fault("node-mismatch")]
    assert faults_of(["something new"]) == [Fault("fault")]
    node = Node(str(HOSTS / "hgx-h100"))
    (found,) = [f for f in node.devices() if f.address == "0000:18:00.0"]
    foreign = replace(found.pci, driver="vfio-pci")
    assert faults_of(unbound_verdict(found.profile, foreign).reasons) == [Fault("unbound", "vfio-pci")]


def test_a_verdict_becomes_taints_in_the_drivers_domain() -> None:
    reasons = ("0000:18:00.0: fatal Xid 79", "0000:18:00.0: AER fatal errors 0 -> 3",
               "0000:18:00.0: PCIe link x8 of x16")
    taints = taints_for(DRIVER, reasons, NO_SCHEDULE, lambda key: "2026-12-01T20:00:00Z")
    assert [(t.key, t.value, t.effect) for t in taints] == [
        (f"{DRIVER}/xid", "79", NO_SCHEDULE), (f"{DRIVER}/aer-fatal", "3", NO_SCHEDULE),
        (f"{DRIVER}/link", "x8-of-x16", NO_SCHEDULE)]
    opted_in = taints_for(DRIVER, reasons, NO_EXECUTE, lambda key: "2026-12-01T20:00:00Z")
    assert [t.effect for t in opted_in] == [NO_EXECUTE, NO_EXECUTE, NO_SCHEDULE]  # only the fatal ones evict
    for taint in [*taints, *taints_for(DRIVER, ("x" * 300,), NO_SCHEDULE, lambda key: "t")]:
        assert LABEL_NAME.match(taint.key) and LABEL_VALUE.match(taint.value), taint
    assert Taint(f"{DRIVER}/gone", "", NO_SCHEDULE, "t").to_json() == {
        "key": f"{DRIVER}/gone", "effect": NO_SCHEDULE, "timeAdded": "t"}  # no empty value


def test_label_values_are_valid_whatever_the_detail() -> None:
    for text in ("79", "vfio-pci", "-x-", "a b/c", "é" * 80, "." * 70, "x" * 100 + "!"):
        value = label_value(text)
        assert LABEL_VALUE.match(value) and len(value) <= 63, (text, value)


def test_the_health_loops_reasons_reach_the_offer_and_its_partitions() -> None:
    node = Node(str(HOSTS / "dgx-a100-mig"))
    offered = offers(node, "node1")
    gpu = next(o for o in offered if o.partition is not None)
    parent_key = f"{gpu.kind}={gpu.device.address}"
    health = NodeHealth(reasons={parent_key: ("x: fatal Xid 48",)})
    assert fault_reasons(node.host, gpu, health) == ("x: fatal Xid 48",)
    whole = next(o for o in offered if o.partition is None and o.channel is None
                 and o.device.address == gpu.device.address)
    assert fault_reasons(node.host, whole, health) == ("x: fatal Xid 48",)
    assert fault_reasons(node.host, whole, NodeHealth(reasons={parent_key: ()})) == (
        "taken out by the node's health checks",)
    others = [o for o in offered if o.channel is None and o.device.address != gpu.device.address]
    assert all(fault_reasons(node.host, o, health) == () for o in others)


def _many_gpus(count: int) -> list[Any]:
    (gpu, *_) = [o for o in offers(Node(str(HOSTS / "hgx-h100")), "node1") if o.kind == "nvidia.com/gpu"]
    return [replace(gpu, name=f"gpu-{n}") for n in range(count)]


def test_a_pool_with_a_tainted_device_is_cut_in_slices_of_64() -> None:
    untainted = resource_slices(DRIVER, "node1", _many_gpus(100))
    assert [len(s["spec"]["devices"]) for s in untainted] == [100]  # up to 128 without taints
    gpus = _many_gpus(100)
    gpus[70] = replace(gpus[70], taints=(Taint(f"{DRIVER}/xid", "79", NO_SCHEDULE, "2026-12-01T20:00:00Z"),))
    tainted = resource_slices(DRIVER, "node1", gpus)
    assert [len(s["spec"]["devices"]) for s in tainted] == [64, 36]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in tainted} == {2}
    for s in [*untainted, *tainted]:
        devices = s["spec"]["devices"]
        assert len(devices) <= (MAX_DEVICES_WITH_COUNTERS if any("taints" in d for d in devices) else MAX_DEVICES)
    (device,) = [d for s in tainted for d in s["spec"]["devices"] if d["name"] == "gpu-70"]
    assert device["taints"] == [{"key": f"{DRIVER}/xid", "value": "79", "effect": NO_SCHEDULE,
                                 "timeAdded": "2026-12-01T20:00:00Z"}]


def test_a_taints_time_is_not_a_change_and_is_kept_from_the_published_slice() -> None:
    """The API server fills in a timeAdded the driver leaves out, and a restarted driver's is new: neither
    republishes a slice, and a replaced slice keeps the time the old one carries."""
    gpus = _many_gpus(2)
    gpus[0] = replace(gpus[0], taints=(Taint(f"{DRIVER}/xid", "79", NO_SCHEDULE, "2026-12-01T21:00:00Z"),))
    (mine,) = resource_slices(DRIVER, "node1", gpus)
    (old,) = resource_slices(DRIVER, "node1", [replace(gpus[0], taints=(
        Taint(f"{DRIVER}/xid", "79", NO_SCHEDULE, "2026-12-01T20:00:00Z"),)), gpus[1]])
    assert _content(mine) == _content(old)
    keep_taint_times(mine, old)
    assert mine["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2026-12-01T20:00:00Z"
    other = resource_slices(DRIVER, "node1", [replace(gpus[0], taints=(
        Taint(f"{DRIVER}/xid", "48", NO_SCHEDULE, "2026-12-01T22:00:00Z"),)), gpus[1]])[0]
    assert _content(other) != _content(old)
    keep_taint_times(other, old)  # another fault: its own time
    assert other["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2026-12-01T22:00:00Z"

