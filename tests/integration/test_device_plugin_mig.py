"""`devinject device-plugin --mig-strategy mixed` against the kubelet's side of the API over real unix sockets
(tests/integration/fake_kubelet.py), on the DGX A100 fixture with the stub libnvidia-ml built from it (its GPU
0000:07:00.0 split into two 3g.40gb MIG devices, 0000:87:00.0 whole): nvidia.com/gpu and nvidia.com/mig-3g.40gb
each registered on a socket of its own, each ListAndWatch listing its own devices, Allocate of a MIG device
answering its CDI name, booked in the node's ledger with its GPU's node shared, as for nvidia.com/gpu."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.deviceplugin.migstrategy import MIXED
from devinject.specs.generate import GenerateOptions
from tests.integration.fake_kubelet import FakeKubelet

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-3g.40gb"
MIG_IDS = ["0000:07:00.0-gi1-ci0", "0000:07:00.0-gi2-ci0"]
WHOLE = "0000:87:00.0"


@pytest.fixture
def mixed(nvml_host, tmp_path) -> Iterator[tuple[FakeKubelet, Path]]:  # type: ignore[no-untyped-def]
    root = nvml_host("dgx-a100-mig")
    plugin_dir = tempfile.mkdtemp(prefix="dp-", dir="/tmp")  # short: a unix socket path has at most 107 bytes
    gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=(GPU,), nvml=True)
    watch = WatchOptions(generate=gen, output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state"), interval=0.1,
                         recheck=0.05, threshold=2, rescan=3600, uevents=False, probe_timeout=1.0)
    agent = DevicePluginAgent(PluginOptions(watch=watch, plugin_dir=plugin_dir, kubelet_poll=0.2,
                                            mig_strategy=MIXED))
    kubelet = FakeKubelet(plugin_dir)
    kubelet.start()
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert kubelet.wait_for(lambda: kubelet.latest(MIG) and kubelet.latest(GPU)), "not both registered"
        yield kubelet, tmp_path / "state"
    finally:
        stop.set()
        thread.join(timeout=10)
        kubelet.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def test_each_profile_is_a_resource_of_its_own(mixed) -> None:  # type: ignore[no-untyped-def]
    kubelet, _ = mixed
    assert kubelet.plugins[MIG].request.endpoint == "devinject-nvidia.com-mig-3g.40gb.sock"
    assert kubelet.plugins[GPU].request.endpoint == "devinject-nvidia.com-gpu.sock"
    assert sorted(kubelet.latest(MIG)) == MIG_IDS
    assert sorted(kubelet.latest(GPU)) == [WHOLE]
    assert all(health == "Healthy" for health, _ in kubelet.latest(MIG).values())


def test_allocate_gives_the_mig_device_and_books_it(mixed) -> None:  # type: ignore[no-untyped-def]
    kubelet, state = mixed
    stub = kubelet.plugins[MIG].stub
    response = stub.Allocate(api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=[MIG_IDS[1]])]), timeout=5)
    (given,) = response.container_responses
    assert [d.name for d in given.cdi_devices] == [f"{GPU}=0:1"]
    assert given.annotations == {"cdi.k8s.io/devinject_nvidia.com_mig-3g.40gb": f"{GPU}=0:1"}
    assert any(d.host_path.endswith("/dev/nvidia0") for d in given.devices)
    bookings = json.loads((state / "ledger.json").read_text())["allocations"]
    booked = bookings[f"device-plugin:{MIG}:{MIG_IDS[1]}"]
    assert "c 195:0" in booked["shared"] and booked["exclusive"]  # its GPU's node shared, its caps its own
    with pytest.raises(grpc.RpcError) as refused:  # the whole GPU is nvidia.com/gpu's, not the profile's
        stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=[WHOLE])]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown device ID" in refused.value.details()
