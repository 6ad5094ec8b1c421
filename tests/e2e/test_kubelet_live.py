"""`devinject device-plugin` with the real kubelet (../shared/kube: kubelet v1.36 standalone on containerd 1.6
with runc) and static pods asking for `nvidia.com/gpu` (and `nvidia.com/imex-channel`). containerd 1.6 ignores
CDI names, so what reaches the container is the Allocate fallback (devices, mounts, envs) built from the same
spec: exactly the devices the kubelet allocated, the driver library read-only, and a device cgroup that lets
the container reach them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEVINJECT, REPO, require, terminate
from tests.fixtures.build_hosts import DYN, FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live

# The real kubelet and its scripts (see their README): beside the project, or where DEVINJECT_KUBE points.
KUBE = next((p for p in (Path(os.environ.get("DEVINJECT_KUBE", REPO.parent / "shared" / "kube")),
                         REPO.parent / "shared" / "kube", Path("/work/shared/kube")) if (p / "kube-up.sh").exists()),
            REPO.parent / "shared" / "kube")
KUBE_DIR = Path("/tmp/devinject-kube-test")
GPU_ENABLE = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0/enable"
IMEX = "nvidia.com/imex-channel"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


def _until(condition, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@pytest.fixture(scope="module")
def kubelet(live_root: None) -> Iterator[Path]:
    require((KUBE / "kube-up.sh").exists(), f"{KUBE}/kube-up.sh missing")
    env = {**os.environ, "KUBE_DIR": str(KUBE_DIR)}
    up = subprocess.run([str(KUBE / "kube-up.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    try:
        yield KUBE_DIR
    finally:
        subprocess.run([str(KUBE / "kube-down.sh"), "--purge"], env=env, capture_output=True, timeout=300)


class Plugin:
    def __init__(self, work: Path) -> None:
        self.work = work
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = open(work / "plugin.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [DEVINJECT, "-v", "device-plugin", "--host-root", str(work / "host"), "--output-dir", str(work / "cdi"),
             "--state-dir", str(work / "state"), "--kind", "nvidia.com/gpu", "--kind", IMEX, "--test-timings",
             "--interval", "0.5", "--recheck", "0.2", "--threshold", "2", "--no-uevents", "--metrics-address",
             f"127.0.0.1:{self.port}", "--hook-path", DEVINJECT], stdout=self.log, stderr=subprocess.STDOUT)

    def metric(self, text: str) -> str:
        return _get(f"http://127.0.0.1:{self.port}/metrics")[1] if text else ""

    def ready(self) -> bool:
        return _get(f"http://127.0.0.1:{self.port}/readyz")[0] == 200

    def stop(self) -> None:
        terminate(self.process)
        self.log.close()


@pytest.fixture(scope="module")
def plugin(kubelet: Path) -> Iterator[Plugin]:
    work = Path(tempfile.mkdtemp(prefix="dp-live-", dir="/tmp"))
    builder = LibBuilder()
    try:
        host = FakeHost(work / "host", real_nodes=True)
        build_hgx_h100(builder, host)
        host.region(DYN["nvidia-caps-imex-channels"], "nvidia-caps-imex-channels")  # two IMEX channels too
        for channel in (0, 1):
            host.node(f"nvidia-caps-imex-channels/channel{channel}", DYN["nvidia-caps-imex-channels"], channel)
        host.finish(ldconfig=False)  # /proc/devices with their region
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    running = Plugin(work)
    try:
        _until(running.ready, 30, "the plugin to register with the kubelet")
        yield running
    finally:
        running.stop()
        shutil.rmtree(work, ignore_errors=True)


def pod_manifest(name: str, gpus: int, resource: str = "nvidia.com/gpu", script: str | None = None) -> str:
    script = script or ("ls /dev | grep -E '^nvidia[0-9]+$'; cat /dev/nvidia2 /dev/nvidia3; grep libcuda /proc/mounts; "
                        "echo finished; sleep 3600")
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "main", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script],
                                 "resources": {"limits": {resource: gpus}}}]}})


def pod(name: str) -> dict[str, object] | None:
    _, text = _get("http://127.0.0.1:10255/pods")
    for item in json.loads(text or "{}").get("items") or []:
        if item["metadata"]["name"].startswith(f"{name}-"):  # static pods carry the node name
            return item  # type: ignore[no-any-return]
    return None


def pod_log(name: str) -> str:
    logs = sorted(Path("/var/log/pods").glob(f"default_{name}-*/main/0.log"))
    return logs[-1].read_text() if logs else ""


def run_pod(kube: Path, name: str, gpus: int, resource: str = "nvidia.com/gpu", script: str | None = None) -> None:
    (kube / "manifests" / f"{name}.yaml").write_text(pod_manifest(name, gpus, resource, script))


def remove_pod(kube: Path, name: str) -> None:
    (kube / "manifests" / f"{name}.yaml").unlink(missing_ok=True)
    _until(lambda: pod(name) is None, 90, f"pod {name} to go")


def test_pod_gets_exactly_its_gpus_the_driver_read_only_and_the_cgroup(kubelet: Path, plugin: Plugin) -> None:
    run_pod(kubelet, "gpu-two", 2)
    try:
        log = _until(lambda: "finished" in pod_log("gpu-two") and pod_log("gpu-two"), 120, "the pod's output")
        lines = [line.split(" ", 3)[-1] for line in log.splitlines()]
        assert [line for line in lines if line.startswith("nvidia")] == ["nvidia2", "nvidia3"], log
        # the preferred allocation: two GPUs of one NUMA node, index 0 and 1 (minors 2 and 3, probe order)
        assert "can't open '/dev/nvidia2': No such device or address" in log  # the cgroup let it reach the driver
        assert "can't open '/dev/nvidia3': No such device or address" in log
        mounts = [line for line in lines if "libcuda" in line]
        assert mounts and all(" ro," in line for line in mounts), log
        assert any("/libcuda.so.1 " in line for line in mounts)  # the SONAME link, as the spec's hook makes it
        assert 'devinject_allocated_devices_total{resource="nvidia.com/gpu"} 2.0' in plugin.metric("allocated")
    finally:
        remove_pod(kubelet, "gpu-two")


def test_pod_gets_exactly_its_imex_channel_and_the_cgroup(kubelet: Path, plugin: Plugin) -> None:
    """`nvidia.com/imex-channel: 1`: the kubelet allocates one of the two channels the plugin serves, and the
    container has that channel's node alone, reachable through its device cgroup (the kernel has no driver on
    the channels' major: ENXIO, not EPERM)."""
    script = ("ls /dev/nvidia-caps-imex-channels; cat /dev/nvidia-caps-imex-channels/channel*; echo finished; "
              "sleep 3600")
    run_pod(kubelet, "imex-one", 1, IMEX, script)
    try:
        log = _until(lambda: "finished" in pod_log("imex-one") and pod_log("imex-one"), 120, "the pod's output")
        lines = [line.split(" ", 3)[-1] for line in log.splitlines()]
        channels = [line for line in lines if re.fullmatch(r"channel[0-9]+", line)]
        assert len(channels) == 1, log
        assert f"can't open '/dev/nvidia-caps-imex-channels/{channels[0]}': No such device or address" in log, log
        assert f'devinject_allocated_devices_total{{resource="{IMEX}"}} 1.0' in plugin.metric("allocated")
        assert f'devinject_devices{{health="healthy",kind="{IMEX}"}} 2.0' in plugin.metric("devices")
    finally:
        remove_pod(kubelet, "imex-one")


def test_a_taken_out_gpu_is_not_allocatable(kubelet: Path, plugin: Plugin) -> None:
    enable = plugin.work / "host" / GPU_ENABLE
    enable.write_text("0\n")
    try:
        _until(lambda: 'health="unhealthy",kind="nvidia.com/gpu"} 1.0' in plugin.metric("devices"), 30,
               "the take-out")
        run_pod(kubelet, "gpu-all", 8)
        try:
            status = _until(lambda: (p := pod("gpu-all")) and p["status"].get("phase") == "Failed"  # type: ignore[union-attr]
                            and p["status"], 90, "the kubelet to refuse the pod")
            assert status.get("reason") == "UnexpectedAdmissionError", status
        finally:
            remove_pod(kubelet, "gpu-all")
    finally:
        enable.write_text("1\n")
        _until(lambda: 'health="healthy",kind="nvidia.com/gpu"} 8.0' in plugin.metric("devices"), 30, "the put-back")


def test_kubelet_restart_and_the_plugin_registers_again(kubelet: Path, plugin: Plugin) -> None:
    pid = int((kubelet / "run" / "kubelet.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    _until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the kubelet to stop")
    env = {**os.environ, "KUBE_DIR": str(kubelet)}
    up = subprocess.run([str(KUBE / "kube-up.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    _until(lambda: 'devinject_kubelet_registrations_total{resource="nvidia.com/gpu"} 2.0' in plugin.metric("r"),
           30, "a second registration")
    run_pod(kubelet, "gpu-after", 1)
    try:
        log = _until(lambda: "finished" in pod_log("gpu-after") and pod_log("gpu-after"), 120, "the pod's output")
        assert len(re.findall(r" nvidia[0-9]+$", log, flags=re.M)) == 1, log  # one GPU node, as asked
    finally:
        remove_pod(kubelet, "gpu-after")
