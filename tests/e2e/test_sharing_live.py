"""Time-slicing through `devinject device-plugin` with the real kubelet (../shared/kube: kubelet v1.36
standalone on containerd 1.6 with runc, as tests/e2e/test_kubelet_live.py): the config file in NVIDIA's shape,
the kubelet's node capacity of `nvidia.com/gpu.shared` (replicas x GPUs), pods asking for one replica each
spread over the GPUs before any GPU is shared, one asking for two gets two different GPUs, and every one of
them reaches its GPU through its device cgroup."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEVINJECT, terminate
from tests.e2e.test_kubelet_live import _get, _until, kubelet, pod, pod_log, remove_pod, run_pod
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live
__all__ = ["kubelet"]  # the fixture, shared

SHARED = "nvidia.com/gpu.shared"
CONFIG = """version: v1
kind: [nvidia.com/gpu]
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""


@pytest.fixture(scope="module")
def shared_plugin(kubelet: Path) -> Iterator[tuple[Path, int]]:
    work = Path(tempfile.mkdtemp(prefix="dp-shared-", dir="/tmp"))
    builder = LibBuilder()
    try:
        host = FakeHost(work / "host", real_nodes=True)
        build_hgx_h100(builder, host)
        host.finish(ldconfig=False)
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    (work / "dp.yaml").write_text(CONFIG)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(work / "plugin.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [DEVINJECT, "-v", "device-plugin", "--config", str(work / "dp.yaml"), "--host-root", str(work / "host"),
         "--output-dir", str(work / "cdi"), "--state-dir", str(work / "state"), "--test-timings", "--no-uevents",
         "--metrics-address", f"127.0.0.1:{port}", "--hook-path", DEVINJECT], stdout=log, stderr=subprocess.STDOUT)
    try:
        _until(lambda: _get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 30, "the plugin to register")
        yield work, port
    finally:
        terminate(process)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _gpu_nodes(name: str) -> list[str]:
    log = pod_log(name)
    return [line.split(" ", 3)[-1] for line in log.splitlines() if re.search(r" nvidia[0-9]+$", line)]


def test_replicas_spread_over_the_gpus_and_each_pod_reaches_its_own(kubelet: Path, shared_plugin) -> None:  # type: ignore[no-untyped-def]
    names = [f"shared-{i}" for i in range(8)]
    script = ("ls /dev | grep -E '^nvidia[0-9]+$'; for n in /dev/nvidia[0-9]*; do cat $n; done; echo finished; "
              "sleep 3600")
    for name in names:
        run_pod(kubelet, name, 1, SHARED, script)
    run_pod(kubelet, "shared-two", 2, SHARED, script)
    try:
        for name in [*names, "shared-two"]:
            _until(lambda n=name: "finished" in pod_log(n), 180, f"pod {name}'s output")  # type: ignore[misc]
        given = {name: _gpu_nodes(name) for name in names}
        assert all(len(nodes) == 1 for nodes in given.values()), given
        # 8 pods of one replica on 8 GPUs with 2 replicas each: the preferred allocation put no two on one GPU
        # while another was idle (the ninth pod, asking for two, takes the second replica of two GPUs)
        assert len({nodes[0] for nodes in given.values()}) == 8, given
        two = _gpu_nodes("shared-two")
        assert len(two) == 2 and two[0] != two[1], two
        for name in [*names, "shared-two"]:
            log = pod_log(name)
            assert "No such device or address" in log and "Operation not permitted" not in log, log
        status = pod("shared-0")
        assert status is not None and status["status"]["phase"] == "Running"  # type: ignore[index]
    finally:
        for name in [*names, "shared-two"]:
            remove_pod(kubelet, name)


def test_under_runc_the_hook_lets_a_time_sliced_gpu_hold_its_replicas_and_no_more(bundle) -> None:  # type: ignore[no-untyped-def]
    """The hook's booking on a runc node, where the device plugin time-slices nvidia.com/gpu 2 ways (its
    sharing.json in the state dir): two containers on GPU 0 both start, a third is refused by the ledger with
    the count, and once one is deleted (its poststop) the third starts."""
    from devinject.nodestate.profilefacts import write_time_slicing
    from tests.e2e.conftest import container_name
    from tests.e2e.test_ledger_live import _start_detached

    write_time_slicing(str(bundle.state_dir), {"nvidia.com/gpu": 2})
    first, second, third = container_name(), container_name(), container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    try:
        assert _start_detached(bundle, first).returncode == 0
        started = _start_detached(bundle, second)
        assert started.returncode == 0, started.stderr  # exclusive before: "is held by container <first>"
        refused = _start_detached(bundle, third)
        assert refused.returncode != 0 and "time-sliced 2 ways and held by 2 containers" in refused.stderr, \
            refused.stderr
        subprocess.run(["runc", "delete", "-f", third], capture_output=True, timeout=30)
        subprocess.run(["runc", "kill", first, "KILL"], capture_output=True, timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and '"stopped"' not in subprocess.run(
                ["runc", "state", first], capture_output=True, text=True, timeout=30).stdout:
            time.sleep(0.05)
        subprocess.run(["runc", "delete", first], check=True, timeout=30)  # its poststop releases the GPU
        allowed = _start_detached(bundle, third)
        assert allowed.returncode == 0, allowed.stderr
        ledger = json.loads((bundle.state_dir / "ledger.json").read_text())["allocations"]
        assert {c for c in (second, third) if c in ledger} == {second, third}
        assert all(ledger[c]["shared"] and not ledger[c]["exclusive"] for c in (second, third))
    finally:
        for name in (first, second, third):
            subprocess.run(["runc", "delete", "-f", name], capture_output=True, timeout=30)


MPS_CONFIG = """version: v1
kind: [nvidia.com/gpu]
sharing:
  mps:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""


@pytest.fixture(scope="module")
def mps_plugin(kubelet: Path) -> Iterator[Path]:
    """The device plugin with NVIDIA's sharing.mps over the HGX host, whose driver root (the host's /) holds a
    stand-in nvidia-cuda-mps-control (no GPU here: tests/integration/test_dra_sharing.py's, `-f` serves
    until `quit`). The daemons it leaves running when it stops (as a real node keeps its clients') are
    killed at the end."""
    from tests.integration.test_dra_sharing import STAND_IN, kill_stand_ins, unmount_under

    work = Path(tempfile.mkdtemp(prefix="dp-mps-", dir="/tmp"))
    builder = LibBuilder()
    try:
        host = FakeHost(work / "host", real_nodes=True)
        build_hgx_h100(builder, host)
        host.finish(ldconfig=False)
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    control = work / "host/usr/bin/nvidia-cuda-mps-control"
    control.parent.mkdir(parents=True, exist_ok=True)
    control.write_text(STAND_IN)
    control.chmod(0o755)
    (work / "dp.yaml").write_text(MPS_CONFIG)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(work / "plugin.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [DEVINJECT, "-v", "device-plugin", "--config", str(work / "dp.yaml"), "--host-root", str(work / "host"),
         "--output-dir", str(work / "cdi"), "--state-dir", str(work / "state"), "--test-timings", "--no-uevents",
         "--metrics-address", f"127.0.0.1:{port}", "--hook-path", DEVINJECT], stdout=log, stderr=subprocess.STDOUT)
    try:
        _until(lambda: _get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 30, "the plugin to register")
        yield work
    finally:
        terminate(process)
        log.close()
        kill_stand_ins(str(work / "host"))
        unmount_under(str(work / "state"))  # each daemon's tmpfs
        shutil.rmtree(work, ignore_errors=True)


def test_mps_clients_get_their_gpus_daemon(kubelet: Path, mps_plugin: Path) -> None:
    """Two pods of one MPS replica each: each reaches one GPU, with CUDA_MPS_PIPE_DIRECTORY and
    CUDA_MPS_LOG_DIRECTORY set and its replica's own daemon's pipe directory mounted there (the stand-in's
    `visible` file names the GPU it serves: the GPU's UUID), and its thread share; one daemon per replica
    runs."""
    from devinject.agent.mps import MpsDaemons

    script = ("ls /dev | grep -E '^nvidia[0-9]+$'; env | grep '^CUDA_MPS' | sort; "
              "echo \"visible=$(cat /tmp/nvidia-mps/visible)\"; ls /tmp/nvidia-mps; echo finished; sleep 3600")
    names = ["mps-0", "mps-1"]
    for name in names:
        run_pod(kubelet, name, 1, SHARED, script)
    try:
        for name in names:
            _until(lambda n=name: "finished" in pod_log(n), 180, f"pod {name}'s output")  # type: ignore[misc]
        daemons = MpsDaemons(str(mps_plugin / "state"), str(mps_plugin / "host")).running()
        assert len(daemons) == 8 and all(h == [f"device-plugin:{SHARED}:{gpu}::{k}" for k in range(2)]
                                         for gpu, h in daemons.items()), daemons
        for name in names:
            log = pod_log(name)
            assert len(_gpu_nodes(name)) == 1, log
            assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in log and \
                "CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps" in log, log
            assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in log and "control" in log, log
            assert re.search(r"visible=GPU-[0-9a-f-]+", log), log  # its GPU's daemon, named by its UUID
    finally:
        for name in names:
            remove_pod(kubelet, name)
