"""`devinject device-plugin` against a kubelet-side peer over real unix sockets (tests/integration/
fake_kubelet.py): registration, ListAndWatch with health from the watch loop, Allocate, preferred
allocation, kubelet and plugin restarts, the HTTP endpoints. The real kubelet: tests/e2e/test_kubelet_live.py."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.specs.generate import GenerateOptions
from tests.integration.fake_kubelet import FakeKubelet

GPU_PATH = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
GPUS = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
        "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Running:
    def __init__(self, agent: DevicePluginAgent, thread: threading.Thread, stop: threading.Event, root: Path,
                 port: int) -> None:
        self.agent, self.thread, self.stop, self.root, self.port = agent, thread, stop, root, port

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except urllib.error.URLError:
            return 0, ""  # not listening (yet)


def start_agent(root: Path, plugin_dir: Path, state: Path, **extra: object) -> Running:
    gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=("nvidia.com/gpu", "nvidia.com/rdma"))
    watch = WatchOptions(generate=gen, output_dir=state / "cdi", state_dir=str(state / "state"), interval=0.1,
                         recheck=0.05, threshold=2, rescan=3600, uevents=False, probe_timeout=1.0)
    port = _free_port()
    agent = DevicePluginAgent(PluginOptions(watch=watch, plugin_dir=str(plugin_dir), kubelet_poll=0.2,
                                            metrics_address=f"127.0.0.1:{port}", **extra))  # type: ignore[arg-type]
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    return Running(agent, thread, stop, root, port)


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """Short, as the kubelet's is: a unix socket path has at most 107 bytes, pytest's tmp paths are long."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(host_copy, tmp_path, plugin_dir) -> Iterator[tuple[FakeKubelet, Running]]:  # type: ignore[no-untyped-def]
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    running = start_agent(host_copy("hgx-h100"), plugin_dir, tmp_path)
    try:
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu")), "the plugin never registered"
        yield kubelet, running
    finally:
        running.stop.set()
        running.thread.join(timeout=10)
        kubelet.stop()


def test_registers_each_kind_and_streams_stable_ids_with_numa(node) -> None:  # type: ignore[no-untyped-def]
    kubelet, _ = node
    assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/rdma"))
    request = kubelet.plugins["nvidia.com/gpu"].request
    assert (request.version, request.endpoint) == ("v1beta1", "devinject-nvidia.com-gpu.sock")
    assert request.options.get_preferred_allocation_available
    assert kubelet.plugins["nvidia.com/gpu"].options.get_preferred_allocation_available
    devices = kubelet.latest("nvidia.com/gpu")
    assert sorted(devices) == GPUS
    assert devices["0000:18:00.0"] == ("Healthy", [0]) and devices["0000:db:00.0"] == ("Healthy", [1])


def test_a_taken_out_device_turns_unhealthy_and_back(node) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = node
    enable = running.root / GPU_PATH / "enable"
    enable.write_text("0\n")
    assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu")["0000:18:00.0"][0] == "Unhealthy")
    assert all(kubelet.latest("nvidia.com/gpu")[g][0] == "Healthy" for g in GPUS[1:])
    stub = kubelet.plugins["nvidia.com/gpu"].stub
    with pytest.raises(grpc.RpcError) as refused:  # an unhealthy device is an error, not a partial answer
        stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:2a:00.0", "0000:18:00.0"])]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unhealthy" in refused.value.details()
    enable.write_text("1\n")
    assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu")["0000:18:00.0"][0] == "Healthy")
    status, text = running.get("/metrics")
    assert status == 200 and 'devinject_take_outs_total{kind="nvidia.com/gpu"} 1.0' in text
    assert 'devinject_put_backs_total{kind="nvidia.com/gpu"} 1.0' in text


def test_allocate_answers_cdi_names_and_a_fallback_from_the_same_spec(node) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = node
    stub = kubelet.plugins["nvidia.com/gpu"].stub
    response = stub.Allocate(api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=["0000:18:00.0", "0000:2a:00.0"]),
        api.ContainerAllocateRequest(devices_ids=["0000:db:00.0"])]), timeout=5)
    first, second = response.container_responses
    assert [d.name for d in first.cdi_devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert [d.name for d in second.cdi_devices] == ["nvidia.com/gpu=7"]
    nodes = {d.container_path: (d.host_path, d.permissions) for d in first.devices}
    assert nodes["/dev/nvidia2"] == (f"{running.root}/dev/nvidia2", "rw")  # index 0 is minor 2 (probe order)
    assert "/dev/nvidiactl" in nodes and "/dev/nvidia5" not in nodes
    mounts = {m.container_path: (m.host_path, m.read_only) for m in first.mounts}
    cuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"
    assert mounts[cuda] == (f"{running.root}{cuda}", True)
    assert mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"] == (f"{running.root}{cuda}", True)  # the SONAME link
    assert mounts["/usr/lib/x86_64-linux-gnu/libcuda.so"] == (f"{running.root}{cuda}", True)  # and -lcuda's
    assert all(read_only for _, read_only in mounts.values())
    assert dict(first.annotations) == {"cdi.k8s.io/devinject_nvidia.com_gpu": "nvidia.com/gpu=0,nvidia.com/gpu=1"}
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:18:00.0", "0000:99:00.0"])]), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "0000:99:00.0" in unknown.value.details()
    status, text = running.get("/metrics")
    assert 'devinject_allocated_devices_total{resource="nvidia.com/gpu"} 3.0' in text
    assert 'devinject_devices{health="healthy",kind="nvidia.com/gpu"} 8.0' in text
    assert 'devinject_allocate_refusals_total{resource="nvidia.com/gpu"} 1.0' in text


def test_allocate_grants_each_container_its_devices_for_the_hook(node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The hook serves a pod's container only what the plugin granted it: a token in its env naming a record in
    the state dir, which the first pod presenting it binds (nodestate/grants.py)."""
    from devinject.nodestate.grants import grant_env_key, redeem

    kubelet, _ = node
    stub = kubelet.plugins["nvidia.com/gpu"].stub
    response = stub.Allocate(api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=["0000:18:00.0"]),
        api.ContainerAllocateRequest(devices_ids=["0000:db:00.0"])]), timeout=5)
    tokens = [dict(c.envs)[grant_env_key("nvidia.com/gpu")] for c in response.container_responses]
    assert len(set(tokens)) == 2
    state = str(tmp_path / "state")
    socket = kubelet.plugins["nvidia.com/gpu"].request.endpoint
    assert stat.S_IMODE(os.stat(os.path.join(kubelet.plugin_dir, socket)).st_mode) == 0o600  # whatever the umask
    assert redeem(state, [tokens[0]], "pod-a") == (["nvidia.com/gpu=0"], [])
    assert redeem(state, [tokens[1]], "pod-b") == (["nvidia.com/gpu=7"], [])
    assert redeem(state, [tokens[0]], "pod-b")[0] == []  # bound to pod-a


def test_hook_latency_comes_from_the_hooks_log(node) -> None:  # type: ignore[no-untyped-def]
    import json

    kubelet, running = node
    assert "devinject_hook_duration_ms NaN" in running.get("/metrics")[1]  # no hook has run: unknown, not 0
    log = running.root / "var/log/devinject/hook.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    records = [{"stage": "prestart", "duration_ms": 12.5}, {"stage": "poststop", "duration_ms": 3.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert kubelet.wait_for(lambda: "devinject_hook_duration_ms 12.5" in running.get("/metrics")[1], timeout=10)


def test_preferred_allocation_keeps_devices_close(node) -> None:  # type: ignore[no-untyped-def]
    kubelet, _ = node
    stub = kubelet.plugins["nvidia.com/gpu"].stub

    def prefer(available: list[str], must: list[str], size: int) -> list[str]:
        response = stub.GetPreferredAllocation(api.PreferredAllocationRequest(container_requests=[
            api.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=must,
                                                    allocation_size=size)]), timeout=5)
        return list(response.container_responses[0].deviceIDs)

    assert prefer(GPUS, ["0000:9a:00.0"], 2) == ["0000:9a:00.0", "0000:ab:00.0"]  # same socket as the must
    assert prefer(GPUS, [], 4) == GPUS[:4]  # one NUMA node, not 2+2 across sockets
    mixed = ["0000:18:00.0", "0000:9a:00.0", "0000:ab:00.0"]
    assert prefer(mixed, [], 2) == ["0000:9a:00.0", "0000:ab:00.0"]


def test_kubelet_restart_means_register_again(node) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = node
    before = len(kubelet.registrations)
    kubelet.stop()
    kubelet.start()  # a new kubelet.sock, and our sockets removed, as the real kubelet does
    assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") and kubelet.latest("nvidia.com/rdma"))
    assert len(kubelet.registrations) >= before + 2
    assert sorted(kubelet.latest("nvidia.com/gpu")) == GPUS
    assert kubelet.wait_for(lambda: running.get("/readyz")[0] == 200) and running.get("/healthz")[0] == 200


def test_plugin_restart_keeps_ids(node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = node
    first = sorted(kubelet.latest("nvidia.com/gpu"))
    running.stop.set()
    running.thread.join(timeout=10)
    again = start_agent(running.root, Path(kubelet.plugin_dir), tmp_path)
    try:
        count = len(kubelet.registrations)
        assert kubelet.wait_for(lambda: len(kubelet.registrations) > count)
        assert kubelet.wait_for(lambda: sorted(kubelet.latest("nvidia.com/gpu") or {}) == first)
    finally:
        again.stop.set()
        again.thread.join(timeout=10)


def test_not_ready_without_a_kubelet(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    running = start_agent(host_copy("hgx-h100"), plugin_dir, tmp_path)
    try:
        kubelet = FakeKubelet(str(plugin_dir))
        assert kubelet.wait_for(lambda: running.get("/healthz")[0] == 200, timeout=5)
        assert running.get("/readyz")[0] == 503  # no kubelet to register with
        kubelet.start()  # the kubelet comes up later: the plugin registers
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu"))
        assert kubelet.wait_for(lambda: running.get("/readyz")[0] == 200, timeout=5)
        kubelet.stop()
    finally:
        running.stop.set()
        running.thread.join(timeout=10)


def test_mig_devices_are_offered_and_allocated_as_units(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    running = start_agent(host_copy("dgx-a100-mig"), plugin_dir, tmp_path)
    try:
        devices = kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu"))
        assert sorted(devices) == ["0000:07:00.0-gi1-ci0", "0000:07:00.0-gi2-ci0", "0000:87:00.0"]
        stub = kubelet.plugins["nvidia.com/gpu"].stub
        response = stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:07:00.0-gi2-ci0"])]), timeout=5)
        (answer,) = response.container_responses
        assert [d.name for d in answer.cdi_devices] == ["nvidia.com/gpu=0:1"]
        paths = [d.container_path for d in answer.devices]
        assert {"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"} <= set(paths)
        assert "/dev/nvidia-caps/nvidia-cap12" not in paths and "/dev/nvidia1" not in paths
        preferred = stub.GetPreferredAllocation(api.PreferredAllocationRequest(container_requests=[
            api.ContainerPreferredAllocationRequest(available_deviceIDs=sorted(devices), allocation_size=2)]),
            timeout=5)
        assert list(preferred.container_responses[0].deviceIDs) == sorted(devices)[:2]  # one GPU's instances
    finally:
        running.stop.set()
        running.thread.join(timeout=10)
        kubelet.stop()


def test_a_stopped_agent_leaves_no_socket_of_its_own(node) -> None:  # type: ignore[no-untyped-def]
    """Its pod deleted (SIGTERM; an uninstall, a roll): the kubelet keeps a stopped plugin's socket in its
    directory; the agent's servers remove their own as they stop (gRPC unlinks the socket it bound, while it
    is the same file), and one made since in its place (a new agent's) stays."""
    kubelet, running = node
    plugin_dir = Path(kubelet.plugin_dir)
    assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/rdma"))
    ours = {"devinject-nvidia.com-gpu.sock", "devinject-nvidia.com-rdma.sock"}
    assert ours <= {p.name for p in plugin_dir.iterdir()}
    replaced = plugin_dir / "devinject-nvidia.com-rdma.sock"
    replaced.unlink()
    replaced.write_text("")  # another agent's now
    running.stop.set()
    running.thread.join(timeout=10)
    assert not running.thread.is_alive()
    assert sorted(p.name for p in plugin_dir.iterdir() if p.name.startswith("devinject-")) == [replaced.name]
