"""Time-slicing through `devinject device-plugin` against the kubelet's side over real unix sockets
(tests/integration/fake_kubelet.py): NVIDIA's `sharing.timeSlicing` config, the renamed resource, replicas
`<PCI address>::<k>` with their GPU's NUMA node and health, the preferred allocation over the least-shared
GPUs, Allocate answering a GPU's CDI device once and refusing two replicas of one GPU (or, with
failRequestsGreaterThanOne, any second replica), the same IDs after a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.deviceplugin.sharing import SharingConfig, TimeSliced
from devinject.nodestate.profilefacts import time_slicing
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_device_plugin import GPU_PATH, GPUS, Running, plugin_dir, start_agent

__all__ = ["plugin_dir"]  # the fixture, shared

SHARED = "nvidia.com/gpu.shared"
REPLICAS = 4


def _running(kubelet: FakeKubelet, root: Path, tmp_path: Path, sharing: SharingConfig) -> Running:
    running = start_agent(root, Path(kubelet.plugin_dir), tmp_path, sharing=sharing)
    assert kubelet.wait_for(lambda: kubelet.latest(SHARED) and kubelet.latest("nvidia.com/rdma")), \
        "the time-sliced resource never registered"
    return running


def _stop(running: Running) -> None:
    running.stop.set()
    running.thread.join(timeout=10)


@pytest.fixture
def shared_node(host_copy, tmp_path, plugin_dir) -> Iterator[tuple[FakeKubelet, Running]]:  # type: ignore[no-untyped-def]
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    sharing = SharingConfig((TimeSliced("nvidia.com/gpu", REPLICAS),), rename_by_default=True)
    running = _running(kubelet, host_copy("hgx-h100"), tmp_path, sharing)
    try:
        yield kubelet, running
    finally:
        _stop(running)
        kubelet.stop()


def _prefer(stub: object, available: list[str], size: int, must: list[str] | None = None) -> list[str]:
    response = stub.GetPreferredAllocation(api.PreferredAllocationRequest(container_requests=[  # type: ignore[attr-defined]
        api.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=must or [],
                                                allocation_size=size)]), timeout=5)
    return list(response.container_responses[0].deviceIDs)


def test_the_kubelet_sees_replicas_under_the_shared_name(shared_node) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = shared_node
    assert "nvidia.com/gpu" not in kubelet.plugins  # renamed: only the shared resource is offered
    request = kubelet.plugins[SHARED].request
    assert request.endpoint == "devinject-nvidia.com-gpu.shared.sock"
    devices = kubelet.latest(SHARED)
    assert sorted(devices) == sorted(f"{gpu}::{k}" for gpu in GPUS for k in range(REPLICAS))
    assert devices["0000:18:00.0::3"] == ("Healthy", [0]) and devices["0000:db:00.0::0"] == ("Healthy", [1])
    assert len(kubelet.latest("nvidia.com/rdma")) == 8  # not time-sliced: one device each, as before
    # and the ledger (the hook) knows: each GPU is booked shared by at most 4 containers
    assert time_slicing(running.agent.opts.watch.state_dir) == {"nvidia.com/gpu": REPLICAS}


def test_a_taken_out_gpu_takes_all_its_replicas_out_together(shared_node) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = shared_node
    enable = running.root / GPU_PATH / "enable"
    enable.write_text("0\n")
    assert kubelet.wait_for(lambda: kubelet.latest(SHARED)["0000:18:00.0::0"][0] == "Unhealthy")
    listed = kubelet.latest(SHARED)
    assert [listed[f"0000:18:00.0::{k}"][0] for k in range(REPLICAS)] == ["Unhealthy"] * REPLICAS
    assert all(h == "Healthy" for i, (h, _) in listed.items() if not i.startswith("0000:18:00.0"))
    # no list in between showed some of its replicas out and others in
    for seen in kubelet.plugins[SHARED].lists:
        assert len({seen[f"0000:18:00.0::{k}"][0] for k in range(REPLICAS)}) == 1
    enable.write_text("1\n")
    assert kubelet.wait_for(lambda: all(kubelet.latest(SHARED)[f"0000:18:00.0::{k}"][0] == "Healthy"
                                        for k in range(REPLICAS)))


def test_preferred_allocation_spreads_over_the_least_shared_gpus(shared_node) -> None:  # type: ignore[no-untyped-def]
    kubelet, _ = shared_node
    stub = kubelet.plugins[SHARED].stub
    free = sorted(kubelet.latest(SHARED))
    given = []
    for _ in range(len(GPUS) + 2):  # one replica at a time, as pods come: every GPU once before any twice
        pick = _prefer(stub, free, 1)
        assert len(pick) == 1
        free.remove(pick[0])
        given.append(pick[0].partition("::")[0])
    assert sorted(given[:len(GPUS)]) == GPUS and len(set(given[len(GPUS):])) == 2
    two = _prefer(stub, free, 2)
    assert len({i.partition("::")[0] for i in two}) == 2  # a pod asking for two gets two GPUs


def test_allocate_gives_a_gpu_once_and_refuses_two_replicas_of_one(shared_node) -> None:  # type: ignore[no-untyped-def]
    kubelet, _ = shared_node
    stub = kubelet.plugins[SHARED].stub
    response = stub.Allocate(api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::0", "0000:2a:00.0::3"]),
        api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::1"])]), timeout=5)
    first, second = response.container_responses
    assert [d.name for d in first.cdi_devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert [d.name for d in second.cdi_devices] == ["nvidia.com/gpu=0"]  # another pod's slice of GPU 0
    assert dict(second.annotations) == {"cdi.k8s.io/devinject_nvidia.com_gpu.shared": "nvidia.com/gpu=0"}
    assert len([d for d in second.devices if d.container_path == "/dev/nvidia2"]) == 1
    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::2", "0000:18:00.0::3"])]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one device (0000:18:00.0)" in refused.value.details()


def test_fail_requests_greater_than_one_and_the_same_ids_after_a_restart(host_copy, tmp_path,  # type: ignore[no-untyped-def]
                                                                        plugin_dir) -> None:
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    root = host_copy("hgx-h100")
    strict = SharingConfig((TimeSliced("nvidia.com/gpu", 2, "nvidia.com/gpu-half"),),
                           fail_requests_greater_than_one=True)
    running = start_agent(root, plugin_dir, tmp_path, sharing=strict)
    try:
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu-half"))
        first = sorted(kubelet.latest("nvidia.com/gpu-half"))
        assert len(first) == 2 * len(GPUS)
        stub = kubelet.plugins["nvidia.com/gpu-half"].stub
        with pytest.raises(grpc.RpcError) as refused:
            stub.Allocate(api.AllocateRequest(container_requests=[
                api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::0", "0000:2a:00.0::0"])]), timeout=5)
        assert "failRequestsGreaterThanOne" in refused.value.details()
        one = stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:2a:00.0::1"])]), timeout=5)
        assert [d.name for d in one.container_responses[0].cdi_devices] == ["nvidia.com/gpu=1"]
        _stop(running)
        count = len(kubelet.registrations)
        running = start_agent(root, plugin_dir, tmp_path, sharing=strict)
        assert kubelet.wait_for(lambda: len(kubelet.registrations) > count)
        assert kubelet.wait_for(lambda: sorted(kubelet.latest("nvidia.com/gpu-half") or {}) == first)
    finally:
        _stop(running)
        kubelet.stop()
