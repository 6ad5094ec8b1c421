"""`devinject device-plugin --mig-strategy mixed` with the real kubelet (../shared/kube: kubelet standalone on
containerd 1.6 with runc, as tests/e2e/test_kubelet_live.py) on the DGX A100 fixture built with real device
nodes and the stub libnvidia-ml built from it (tests/nvmlstub): the kubelet takes `nvidia.com/mig-3g.40gb`
(two MIG devices of GPU 0) and `nvidia.com/gpu` (the whole GPU 1) as two resources, and a static pod asking
`nvidia.com/mig-3g.40gb: 1` gets its GPU's node and exactly one MIG device's capability nodes, through the
Allocate fallback (containerd 1.6 ignores CDI names), while a pod asking `nvidia.com/gpu: 1` gets GPU 1 alone.
Run it under the kube lock: `flock /tmp/devinject-kube.lock .venv/bin/pytest -q tests/e2e/test_kubelet_mig_live.py`."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import test_kubelet_live as live
from tests.e2e.conftest import DEVINJECT, terminate
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_dgx_a100_mig
from tests.integration.test_device_plugin import _free_port

pytestmark = pytest.mark.live

kubelet = live.kubelet  # this module's own kubelet, up and down around it
MIG = "nvidia.com/mig-3g.40gb"
# the capability nodes of each MIG device (GI 1, GI 2; build_dgx_a100_mig numbers them as nv-caps.c), with the
# MIG monitor capability (nvidia-cap2) that every MIG device's spec shares
MIG_CAPS = ({"nvidia-cap12", "nvidia-cap13", "nvidia-cap2"}, {"nvidia-cap21", "nvidia-cap22", "nvidia-cap2"})


@pytest.fixture(scope="module")
def mixed_plugin(kubelet: Path, nvml_stubs) -> Iterator[tuple[Path, int]]:  # type: ignore[no-untyped-def]
    from tests.nvmlstub import install_stub

    work = Path(tempfile.mkdtemp(prefix="dp-mig-", dir="/tmp"))
    host = FakeHost(work / "host", real_nodes=True)
    with contextlib.ExitStack() as scratch:
        builder = LibBuilder()
        scratch.callback(shutil.rmtree, builder.tmp, ignore_errors=True)
        build_dgx_a100_mig(builder, host)
        host.finish(ldconfig=False)  # /proc/devices with the nvidia-caps region
    install_stub(work / "host", nvml_stubs("dgx-a100-mig"))  # built from the fixture's data, the same as this
    port = _free_port()
    command = [DEVINJECT, "-v", "device-plugin", "--host-root", str(work / "host"), "--output-dir", str(work / "cdi"),
               "--state-dir", str(work / "state"), "--kind", "nvidia.com/gpu", "--mig-strategy", "mixed", "--nvml",
               "--test-timings", "--interval", "0.5", "--recheck", "0.2", "--threshold", "2", "--no-uevents",
               "--metrics-address", f"127.0.0.1:{port}", "--hook-path", DEVINJECT]
    with open(work / "plugin.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            live._until(lambda: live._get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60,
                        "both resources to register with the kubelet")
            yield work, port
        finally:
            terminate(process)
            shutil.rmtree(work, ignore_errors=True)


def test_a_pod_asking_a_profile_gets_one_mig_device_and_a_gpu_pod_the_whole_gpu(  # type: ignore[no-untyped-def]
        kubelet: Path, mixed_plugin) -> None:
    _, port = mixed_plugin
    metrics = live._get(f"http://127.0.0.1:{port}/metrics")[1]
    assert f'devinject_kubelet_registrations_total{{resource="{MIG}"}} 1.0' in metrics
    assert 'devinject_kubelet_registrations_total{resource="nvidia.com/gpu"} 1.0' in metrics
    mig_script = ("ls /dev/nvidia-caps; ls /dev | grep -E '^nvidia[0-9]+$'; cat /dev/nvidia0; "
                  "for c in /dev/nvidia-caps/*; do cat $c; done; echo finished; sleep 3600")
    gpu_script = "ls /dev | grep -E '^nvidia[0-9]+$'; ls /dev/nvidia-caps; cat /dev/nvidia1; echo finished; sleep 3600"
    live.run_pod(kubelet, "mig-one", 1, MIG, mig_script)
    live.run_pod(kubelet, "whole-one", 1, "nvidia.com/gpu", gpu_script)
    try:
        log = live._until(lambda: "finished" in live.pod_log("mig-one") and live.pod_log("mig-one"), 120,
                          "the MIG pod's output")
        lines = [line.split(" ", 3)[-1] for line in log.splitlines()]
        caps = {line for line in lines if re.fullmatch(r"nvidia-cap[0-9]+", line)}
        assert caps in MIG_CAPS, log  # exactly one MIG device's GI and CI nodes, and the monitor's
        assert [line for line in lines if re.fullmatch(r"nvidia[0-9]+", line)] == ["nvidia0"], log
        assert "can't open '/dev/nvidia0': No such device or address" in log, log  # its cgroup lets it reach them
        for cap in caps:
            assert f"can't open '/dev/nvidia-caps/{cap}': No such device or address" in log, log
        log = live._until(lambda: "finished" in live.pod_log("whole-one") and live.pod_log("whole-one"), 120,
                          "the GPU pod's output")
        lines = [line.split(" ", 3)[-1] for line in log.splitlines()]
        assert [line for line in lines if re.fullmatch(r"nvidia[0-9]+", line)] == ["nvidia1"], log
        assert not [line for line in lines if line.startswith("nvidia-cap")], log
        assert "can't open '/dev/nvidia1': No such device or address" in log, log
        metrics = live._get(f"http://127.0.0.1:{port}/metrics")[1]
        assert f'devinject_allocated_devices_total{{resource="{MIG}"}} 1.0' in metrics
    finally:
        live.remove_pod(kubelet, "mig-one")
        live.remove_pod(kubelet, "whole-one")
