"""A failing GPU stays out of service across a restart of `device-plugin`, as the real kubelet sees it
(../shared/kube: kubelet v1.36 standalone). The kubelet's own record of a resource's healthy devices is its
device-manager checkpoint (`RegisteredDevices` lists the healthy ones), and a pod asking for every GPU is
refused at admission while one is unhealthy. The old agent took the AER total it found at start as its
baseline: 1.65 s after a restart the kubelet was offered the failed GPU again."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEVINJECT
from tests.e2e.test_kubelet_live import GPU_ENABLE, Plugin, _until, kubelet, plugin, pod, remove_pod, run_pod

pytestmark = pytest.mark.live
__all__ = ["kubelet", "plugin"]  # the live kubelet module's fixtures: its kubelet, started and stopped here

CHECKPOINT = Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
GPU = "0000:18:00.0"
KEY = f"nvidia.com/gpu={GPU}"
AER_FATAL = str(Path(GPU_ENABLE).parent / "aer_dev_fatal")
ALL_GPUS = {"0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0",
            "0000:ba:00.0", "0000:db:00.0"}


def kubelet_healthy() -> set[str]:
    """The GPUs the kubelet holds healthy now (its checkpoint, rewritten on every ListAndWatch update)."""
    try:
        data = json.loads(CHECKPOINT.read_text())
    except (OSError, ValueError):
        return set()
    return set((data.get("Data", {}).get("RegisteredDevices") or {}).get("nvidia.com/gpu") or [])


def events(work: Path) -> list[dict[str, object]]:
    path = work / "state" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def restartable(plugin: Plugin) -> Iterator[list[Plugin]]:
    """The module's plugin, then each restart of it with the same work dir (host, specs, state): the last one
    is stopped here, and the module's fixture finds its own already stopped."""
    running = [plugin]
    try:
        yield running
    finally:
        if running[-1] is not plugin:
            running[-1].stop()


def test_a_gpu_out_for_aer_fatal_stays_out_across_a_restart_until_put_back(kubelet: Path,
                                                                           restartable: list[Plugin]) -> None:
    first = restartable[0]
    work = first.work
    aer = work / "host" / AER_FATAL
    _until(lambda: kubelet_healthy() == ALL_GPUS, 30, "the kubelet to hold all eight GPUs healthy")
    aer.write_text("ERR_FATAL 0\nTOTAL_ERR_FATAL 1\n")  # 0 -> 1: a fatal error on GPU 0
    try:
        _until(lambda: kubelet_healthy() == ALL_GPUS - {GPU}, 30, "the take-out to reach the kubelet")
        first.stop()  # a DaemonSet rollout, a crash: a new process, the same state dir
        restarted = Plugin(work)
        restartable.append(restarted)
        _until(restarted.ready, 30, "the restarted plugin to register")
        deadline = time.monotonic() + 5  # the old agent offered the GPU again after 1.65 s
        while time.monotonic() < deadline:
            assert GPU not in kubelet_healthy(), "the restarted agent put the failed GPU back"
            time.sleep(0.1)
        assert kubelet_healthy() == ALL_GPUS - {GPU}
        assert 'health="unhealthy",kind="nvidia.com/gpu"} 1.0' in restarted.metric("devices")
        device = json.loads((work / "state" / "health.json").read_text())["devices"][KEY]
        assert device["published"] == "unhealthy" and any("AER fatal errors 0 -> 1" in r for r in device["reasons"])
        assert not [e for e in events(work) if e["event"] == "put-back"]
        run_pod(kubelet, "gpu-every", 8)  # the kubelet refuses a pod that needs the failed GPU
        try:
            status = _until(lambda: (p := pod("gpu-every")) and p["status"].get("phase") == "Failed"  # type: ignore[union-attr]
                            and p["status"], 90, "the kubelet to refuse the pod")
            assert status.get("reason") == "UnexpectedAdmissionError", status
        finally:
            remove_pod(kubelet, "gpu-every")

        done = subprocess.run([DEVINJECT, "put-back", "--root", str(work / "host"), "--state-dir",
                               str(work / "state"), KEY], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        _until(lambda: kubelet_healthy() == ALL_GPUS, 30, "the put-back to reach the kubelet")
        names = [e["event"] for e in events(work) if e.get("device") == KEY]
        assert names[-3:] == ["put-back-requested", "cleared", "put-back"] or names[-4:] == [
            "put-back-requested", "cleared", "healthy", "put-back"], names
    finally:
        aer.write_text("ERR_FATAL 0\nTOTAL_ERR_FATAL 0\n")
