"""ResourceSlices from discovery (dra/slices.py) on the fixture hosts: names stable and DNS labels, the
standard attributes as the DRA convention defines them, one pool per kind, and MIG instances as partitionable
devices whose counters make the whole GPU and an instance exclusive."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devinject.discovery.node import Node
from devinject.dra.slices import DRIVER, MAX_DEVICES, offers, resource_slices
from tests.conftest import HOSTS

LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
STD = "resource.kubernetes.io"


def slices_of(root: Path | str, node: str = "node1") -> list[dict]:  # type: ignore[type-arg]
    return resource_slices(DRIVER, node, offers(Node(str(root)), node, {"nvidia.com/gpu": "550.54.14"}))


def devices_of(slices: list[dict]) -> dict[str, dict]:  # type: ignore[type-arg]
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def test_hgx_one_pool_per_kind_with_the_standard_attributes() -> None:
    slices = slices_of(HOSTS / "hgx-h100")
    assert sorted(s["spec"]["pool"]["name"] for s in slices) == ["node1-nvidia-com-gpu", "node1-nvidia-com-rdma"]
    assert all(s["spec"]["nodeName"] == "node1" and s["spec"]["driver"] == DRIVER for s in slices)
    devices = devices_of(slices)
    assert len(devices) == 16 and all(LABEL.match(name) for name in devices)
    gpu = devices["gpu-0000-18-00-0"]["attributes"]
    assert gpu == {
        f"{STD}/pciBusID": {"string": "0000:18:00.0"}, f"{STD}/pcieRoot": {"string": "pci0000:12"},
        f"{STD}/numaNode": {"int": 0}, "kind": {"string": "nvidia.com/gpu"}, "vendor": {"string": "NVIDIA"},
        "pciVendorID": {"string": "0x10de"}, "model": {"string": "NVIDIA H100 80GB HBM3"}, "index": {"int": 0},
        "driverVersion": {"version": "550.54.14"}, "partition": {"string": "whole"}, "type": {"string": "gpu"},
        "uuid": {"string": "GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00"}}
    # the GPU and its NIC sit under one root complex: one pcieRoot, so matchAttribute co-locates them
    nic = devices["rdma-0000-19-00-0"]["attributes"]
    assert nic[f"{STD}/pcieRoot"] == gpu[f"{STD}/pcieRoot"]
    assert devices["gpu-0000-9a-00-0"]["attributes"][f"{STD}/numaNode"] == {"int": 1}


def test_names_are_a_pure_function_of_the_host() -> None:
    assert slices_of(HOSTS / "hgx-h100") == slices_of(HOSTS / "hgx-h100")


def test_gpus_on_one_switch_share_their_root(topology_hosts: Path) -> None:
    devices = devices_of(slices_of(topology_hosts / "hgx-h100-4sw"))
    roots: dict[str, set[str]] = {}
    for name, device in devices.items():
        roots.setdefault(device["attributes"][f"{STD}/pcieRoot"]["string"], set()).add(name)
    assert roots["pci0000:15"] >= {"gpu-0000-18-00-0", "gpu-0000-19-00-0"}
    assert len(roots) == 4


def test_numa_node_left_out_when_the_kernel_says_minus_one(topology_hosts: Path) -> None:
    devices = devices_of(slices_of(topology_hosts / "numa-unknown"))
    assert devices and all(f"{STD}/numaNode" not in d["attributes"] for d in devices.values())
    assert all(f"{STD}/pcieRoot" in d["attributes"] for d in devices.values())


def test_mig_instances_are_partitionable_devices_of_their_gpu() -> None:
    slices = slices_of(HOSTS / "dgx-a100-mig")
    counters = [s for s in slices if "sharedCounters" in s["spec"]]
    assert len(counters) == 1 and "devices" not in counters[0]["spec"]  # the API allows one or the other
    (counter_set,) = counters[0]["spec"]["sharedCounters"]
    assert counter_set == {"name": "gpu-0000-07-00-0-partitions",
                           "counters": {"gi1-ci0": {"value": "1"}, "gi2-ci0": {"value": "1"}}}
    pools = sorted((s["spec"]["pool"]["name"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices)
    assert pools == [("node1-nvidia-com-gpu", 2)] * 2 + [("node1-nvidia-com-imex-channel", 1)]  # test_dra_channels
    devices = devices_of(slices)
    whole = devices["gpu-0000-07-00-0"]
    instance = devices["gpu-0000-07-00-0-gi1-ci0"]
    assert whole["consumesCounters"] == [{"counterSet": "gpu-0000-07-00-0-partitions",
                                          "counters": {"gi1-ci0": {"value": "1"}, "gi2-ci0": {"value": "1"}}}]
    assert instance["consumesCounters"] == [{"counterSet": "gpu-0000-07-00-0-partitions",
                                             "counters": {"gi1-ci0": {"value": "1"}}}]
    assert instance["attributes"]["partition"] == {"string": "mig"}
    # NVIDIA's DRA driver's types, which its DeviceClasses gpu.nvidia.com and mig.nvidia.com test
    assert (whole["attributes"]["type"], instance["attributes"]["type"]) == ({"string": "gpu"}, {"string": "mig"})
    assert instance["attributes"][f"{STD}/pciBusID"] == whole["attributes"][f"{STD}/pciBusID"]
    # whole + any instance would take 2 of a counter whose value is 1: the scheduler allocates only one
    for name, device in devices.items():
        if name.startswith("gpu-0000-07-00-0-"):
            (used,) = device["consumesCounters"]
            assert set(used["counters"]) <= set(whole["consumesCounters"][0]["counters"])
    assert "consumesCounters" not in devices["gpu-0000-87-00-0"]  # not partitioned: nothing shared


@pytest.mark.parametrize("host", ["hgx-h100", "dgx-a100-mig", "mi300x", "gaudi2", "workstation"])
def test_slices_are_valid_objects(host: str) -> None:
    """What resource.k8s.io/v1 validation requires of every slice (the live test reads them back)."""
    for s in slices_of(HOSTS / host):
        spec = s["spec"]
        assert ("devices" in spec) != ("sharedCounters" in spec)
        assert len(spec.get("devices", [])) <= MAX_DEVICES
        for device in spec.get("devices", []):
            assert LABEL.match(device["name"]), device["name"]
            assert all(len(v) == 1 and next(iter(v)) in ("string", "int", "bool", "version")
                       for v in device["attributes"].values())
        assert len(s["metadata"]["name"]) <= 253
