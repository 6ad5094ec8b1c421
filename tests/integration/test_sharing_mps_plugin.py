"""MPS through `devinject device-plugin` (NVIDIA's `sharing.mps`) against the kubelet's side over real unix
sockets: each whole GPU offered as its replicas, one MPS control daemon per replica (each on its own tmpfs)
started through the driver root's `nvidia-cuda-mps-control` (the stand-in of tests/integration/
test_dra_sharing.py: `-f` serves until `quit`), Allocate answering the client's env (CUDA_MPS_PIPE_DIRECTORY,
CUDA_MPS_LOG_DIRECTORY, its thread share) and its replica's daemon's directories, one replica a request, a
dead daemon started again, and the ledger counting the GPU's MPS clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.agent.mps import LOG_IN_CONTAINER, PIPE_IN_CONTAINER, MpsDaemons, daemon_name
from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.deviceplugin.sharing import SharingConfig, SharingConfigError, TimeSliced, parse_sharing
from devinject.nodestate.profilefacts import time_slicing
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_device_plugin import GPUS, Running, plugin_dir, start_agent
from tests.integration.test_dra_sharing import STAND_IN, kill_stand_ins, unmount_under

__all__ = ["plugin_dir"]  # the fixture, shared

SHARED = "nvidia.com/gpu.shared"
REPLICAS = 4
HOLDER = f"device-plugin:{SHARED}"


def holder(replica: str) -> str:
    """The holder of a replica's own daemon: its booking in the ledger."""
    return f"{HOLDER}:{replica}"


@pytest.fixture
def mps_node(host_copy, tmp_path, plugin_dir) -> Iterator[tuple[FakeKubelet, Running]]:  # type: ignore[no-untyped-def]
    root = host_copy("hgx-h100")
    control = root / "usr/bin/nvidia-cuda-mps-control"  # the driver root is the host's /
    control.parent.mkdir(parents=True, exist_ok=True)
    control.write_text(STAND_IN)
    control.chmod(0o755)
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    sharing = parse_sharing({"mps": {"renameByDefault": True, "resources": [
        {"name": "nvidia.com/gpu", "replicas": REPLICAS}]}}, "config.yaml")
    running = start_agent(root, plugin_dir, tmp_path, sharing=sharing)
    try:
        assert kubelet.wait_for(lambda: kubelet.latest(SHARED)), "the MPS resource never registered"
        yield kubelet, running
    finally:
        running.stop.set()
        running.thread.join(timeout=10)
        kubelet.stop()
        kill_stand_ins(str(root))
        unmount_under(running.agent.opts.watch.state_dir)


def daemons(running: Running) -> MpsDaemons:
    return MpsDaemons(running.agent.opts.watch.state_dir, str(running.root))


def test_the_config_is_nvidias_shape() -> None:
    config = parse_sharing({"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}, "c.yaml")
    assert config == SharingConfig((TimeSliced("nvidia.com/gpu", 2, mps=True),),
                                   fail_requests_greater_than_one=True)  # implied by MPS
    with pytest.raises(SharingConfigError, match="timeSlicing and mps cannot both be set"):
        parse_sharing({"mps": {"resources": []}, "timeSlicing": {"resources": []}}, "c.yaml")
    with pytest.raises(SharingConfigError, match=r"c.yaml: sharing.mps.resources\[0\].replicas"):
        parse_sharing({"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 0}]}}, "c.yaml")


def test_one_daemon_per_replica_and_the_clients_env(mps_node) -> None:  # type: ignore[no-untyped-def]
    kubelet, running = mps_node
    assert sorted(kubelet.latest(SHARED)) == sorted(f"{gpu}::{k}" for gpu in GPUS for k in range(REPLICAS))
    assert kubelet.wait_for(lambda: sorted(daemons(running).running()) == sorted(GPUS), timeout=60)
    assert daemons(running).running() == {gpu: sorted(holder(f"{gpu}::{k}") for k in range(REPLICAS))
                                          for gpu in GPUS}
    assert time_slicing(running.agent.opts.watch.state_dir) == {"nvidia.com/gpu": REPLICAS}  # the ledger counts
    stub = kubelet.plugins[SHARED].stub
    response = stub.Allocate(api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::1"])]), timeout=5)
    (answer,) = response.container_responses
    assert [d.name for d in answer.cdi_devices] == ["nvidia.com/gpu=0"]
    assert dict(answer.envs).items() >= {"CUDA_MPS_PIPE_DIRECTORY": PIPE_IN_CONTAINER,
                                         "CUDA_MPS_LOG_DIRECTORY": LOG_IN_CONTAINER,
                                         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}.items()
    daemon = daemons(running).daemon(holder("0000:18:00.0::1"))
    assert {(m.container_path, m.host_path, m.read_only) for m in answer.mounts} >= {
        (PIPE_IN_CONTAINER, daemon.pipe_dir, False), (LOG_IN_CONTAINER, daemon.log_dir, True)}  # log: read-only
    assert (Path(daemon.pipe_dir) / "control").exists()  # the replica's own daemon serves there
    (other,) = stub.Allocate(api.AllocateRequest(container_requests=[
        api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::3"])]), timeout=5).container_responses
    theirs = {m.host_path for m in other.mounts}  # another pod on the same GPU: another daemon
    assert daemon.pipe_dir not in theirs and daemons(running).daemon(holder("0000:18:00.0::3")).pipe_dir in theirs
    with pytest.raises(grpc.RpcError) as refused:  # an MPS client is one replica
        stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:18:00.0::2", "0000:2a:00.0::0"])]), timeout=5)
    assert "failRequestsGreaterThanOne" in refused.value.details()


def test_a_dead_daemon_is_started_again(mps_node) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal

    kubelet, running = mps_node
    name = daemon_name(holder("0000:18:00.0::0"))
    assert kubelet.wait_for(lambda: name in daemons(running)._load(), timeout=60)
    record = daemons(running)._load()[name]
    os.kill(int(record["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    assert kubelet.wait_for(lambda: daemons(running)._load()[name]["pid"] != record["pid"]
                            and holder("0000:18:00.0::0") in daemons(running).running()["0000:18:00.0"])


def test_a_dra_driver_on_the_node_leaves_the_plugins_daemons_alone(tmp_path: Path) -> None:
    """The DRA driver's round stops a daemon no prepared claim needs; one the device plugin holds is not its
    claim's, and is left running."""
    import os

    from tests.integration.test_dra_driver import FakeApi, make_driver

    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state", "driver")}
    os.makedirs(dirs["state"], mode=0o755)
    control = Path(dirs["driver"], "usr/bin/nvidia-cuda-mps-control")
    control.parent.mkdir(parents=True)
    control.write_text(STAND_IN)
    control.chmod(0o755)
    try:
        plugin = MpsDaemons(dirs["state"], dirs["driver"])
        plugin.acquire("0000:18:00.0", holder("0000:18:00.0::0"), "0")
        driver = make_driver(dirs, FakeApi())
        driver.preparer.mps = MpsDaemons(dirs["state"], dirs["driver"])
        driver.preparer.rebook()  # its round: no claim is prepared
        assert plugin.running() == {"0000:18:00.0": [holder("0000:18:00.0::0")]}
    finally:
        kill_stand_ins(dirs["driver"])
        unmount_under(dirs["state"])


def recorded_pids(record: Path) -> dict[str, int] | None:
    try:
        return {name: entry["pid"] for name, entry in json.loads(record.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None


def test_a_restarted_plugin_with_a_corrupt_record_adopts_every_daemon(  # type: ignore[no-untyped-def]
        mps_node, tmp_path: Path, plugin_dir: Path) -> None:
    """The plugin stops (its daemons run on: the pods are their clients), daemons.json is corrupt, and a new
    plugin starts: each replica's daemon is found again from /proc and adopted, none started twice."""
    from tests.integration.test_device_plugin import start_agent

    kubelet, running = mps_node
    assert kubelet.wait_for(lambda: len(daemons(running).running().get("0000:18:00.0", [])) == REPLICAS, timeout=60)
    pids = {name: entry["pid"] for name, entry in daemons(running)._load().items()}
    running.stop.set()
    running.thread.join(timeout=10)
    record = Path(running.agent.opts.watch.state_dir, "mps", "daemons.json")
    record.write_text('{"broken": ')
    again = start_agent(running.root, plugin_dir, tmp_path, sharing=running.agent.opts.sharing)
    try:
        assert kubelet.wait_for(lambda: recorded_pids(record) == pids, timeout=60)  # rewritten, the same pids
        assert sum(len(h) for h in daemons(again).running().values()) == len(pids)
    finally:
        again.stop.set()
        again.thread.join(timeout=10)
