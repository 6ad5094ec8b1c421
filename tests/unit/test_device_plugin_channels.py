"""The device plugin serves IMEX channels (profile nvidia-imex-channels) as the resource
`nvidia.com/imex-channel`: one device per channel, ID `channel-N` (the name NVIDIA's DRA driver gives channel
N), healthy while its node is there; Allocate answers with the channel's CDI name and its node. Against the
kubelet's side of the API over real unix sockets (tests/integration/fake_kubelet.py) on the DGX fixture host,
whose /dev/nvidia-caps-imex-channels holds channel0 and channel1."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.deviceplugin.allocation import answer
from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.specs.generate import GenerateOptions
from tests.integration.fake_kubelet import FakeKubelet

KIND = "nvidia.com/imex-channel"
CHANNELS = "dev/nvidia-caps-imex-channels"


def options(root: Path, state: Path, plugin_dir: Path) -> PluginOptions:
    gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=("nvidia.com/gpu", KIND))
    watch = WatchOptions(generate=gen, output_dir=state / "cdi", state_dir=str(state / "state"), interval=0.1,
                         recheck=0.05, threshold=2, rescan=3600, uevents=False, probe_timeout=1.0)
    return PluginOptions(watch=watch, plugin_dir=str(plugin_dir), kubelet_poll=0.2)


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """Short, as the kubelet's is: a unix socket path has at most 107 bytes, pytest's tmp paths are long."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_one_round_offers_each_channel_with_its_cdi_name(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("dgx-a100-mig")
    agent = DevicePluginAgent(options(root, tmp_path, plugin_dir))
    agent.watcher.rescan()
    agent.watcher.check()
    agent.watcher.write()  # its listener publishes the round to the resources
    state = agent.states[KIND]
    assert state.resource == KIND
    assert {i: (d.cdi_name, d.healthy, d.place.numa) for i, d in state.devices.items()} == {
        "channel-0": (f"{KIND}=0", True, None), "channel-1": (f"{KIND}=1", True, None)}
    assert state.spec is not None and state.spec.kind == KIND
    given = answer(KIND, state.spec, state.devices, ["channel-1"])
    assert given.cdi_devices == (f"{KIND}=1",)
    assert given.devices == ((f"/{CHANNELS}/channel1", f"{root}/{CHANNELS}/channel1", "rw"),)
    assert given.annotations == {"cdi.k8s.io/devinject_nvidia.com_imex-channel": f"{KIND}=1"}
    assert "nvidia.com/gpu" in agent.states  # the GPUs as before


def test_channels_over_the_kubelet_socket(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("dgx-a100-mig")
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    agent = DevicePluginAgent(options(root, tmp_path, plugin_dir))
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert kubelet.wait_for(lambda: kubelet.latest(KIND)), "nvidia.com/imex-channel never registered"
        assert kubelet.plugins[KIND].request.endpoint == "devinject-nvidia.com-imex-channel.sock"
        assert kubelet.latest(KIND) == {"channel-0": ("Healthy", []), "channel-1": ("Healthy", [])}
        stub = kubelet.plugins[KIND].stub
        response = stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["channel-0"])]), timeout=5)
        (given,) = response.container_responses
        assert [d.name for d in given.cdi_devices] == [f"{KIND}=0"]
        assert [(d.container_path, d.host_path, d.permissions) for d in given.devices] == [
            (f"/{CHANNELS}/channel0", f"{root}/{CHANNELS}/channel0", "rw")]

        (root / CHANNELS / "channel1").unlink()  # its node is gone: unhealthy, refused, out of the spec
        assert kubelet.wait_for(lambda: kubelet.latest(KIND)["channel-1"][0] == "Unhealthy")
        assert kubelet.latest(KIND)["channel-0"] == ("Healthy", [])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Allocate(api.AllocateRequest(container_requests=[
                api.ContainerAllocateRequest(devices_ids=["channel-1"])]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unhealthy" in refused.value.details()
        spec = (tmp_path / "cdi" / "nvidia.com-imex-channel.yaml").read_text()
        assert "channel0" in spec and "channel1" not in spec

        (root / CHANNELS / "channel1").write_text("")  # back: healthy after the passing checks
        assert kubelet.wait_for(lambda: kubelet.latest(KIND)["channel-1"][0] == "Healthy")
        (root / CHANNELS / "channel2").write_text("")  # a channel made now: offered from the next rescan
        agent.watcher.rescan_requested.set()
        agent.watcher.wake.set()
        assert kubelet.wait_for(lambda: sorted(kubelet.latest(KIND)) == ["channel-0", "channel-1", "channel-2"])
        response = stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["channel-2"])]), timeout=5)
        assert [d.name for d in response.container_responses[0].cdi_devices] == [f"{KIND}=2"]
    finally:
        stop.set()
        thread.join(timeout=10)
        kubelet.stop()
