"""A full NVIDIA driver install in real containers (the dgx-a100-mig host with real nodes and ELF libraries):
podman from the spec gets the Vulkan and OpenCL ICD files and `libcuda.so`, read-only; a MIG device gives
exactly its parent GPU node and capability nodes; the driver's application profile names the container's
GPUs only (podman running the spec's hook, and runc with the OCI hook); under runc the ledger refuses the
whole GPU while one of its MIG instances is held."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.hook.plan import APPLICATION_PROFILE, application_profile
from tests.e2e.conftest import DEVINJECT, PODMAN, Bundle, container_name, in_cdi_dir
from tests.e2e.test_ledger_live import _start_detached
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_dgx_a100_mig

pytestmark = pytest.mark.live

LIB = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture(scope="module")
def dgx_specs(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("dgx")
    builder = LibBuilder()
    try:
        build_dgx_a100_mig(builder, FakeHost(base / "host", real_nodes=True))
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    subprocess.run([DEVINJECT, "generate", "--root", str(base / "host"), "--output-dir", str(base / "cdi"),
                    "--hook-path", DEVINJECT], check=True, capture_output=True)
    return base / "cdi"


@pytest.fixture
def installed(dgx_specs: Path) -> Iterator[None]:
    with in_cdi_dir(dgx_specs / "nvidia.com-gpu.yaml"):
        yield


def test_podman_gets_the_icd_files_and_libcuda_so_read_only(image: str, installed: None) -> None:
    script = ("for f in /etc/vulkan/icd.d/nvidia_icd.json /etc/OpenCL/vendors/nvidia.icd; do "
              "grep \" $f \" /proc/mounts; done; cat /etc/OpenCL/vendors/nvidia.icd; "
              f"readlink {LIB}/libcuda.so; test -f {LIB}/libcuda.so && echo libcuda-resolves; "
              f"grep -c libGLX_nvidia /etc/vulkan/icd.d/nvidia_icd.json; echo $NVIDIA_VISIBLE_DEVICES; "
              "touch /etc/vulkan/icd.d/nvidia_icd.json || echo icd-read-only; echo finished")
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=1", image, "sh", "-c", script],
                          capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "finished" in out, out
    mounts = [line for line in out.splitlines() if line.startswith("/") and " ro," in line]
    assert len(mounts) == 2, out  # both ICD files, mounted read-only
    assert "libnvidia-opencl.so.1" in out and "libcuda.so.1" in out and "libcuda-resolves" in out
    assert "icd-read-only" in out and "void" in out


def test_podman_gets_the_graphics_links_and_files(image: str, installed: None) -> None:
    """What NVIDIA's generator adds for graphics arrives: the GBM backend link resolving to the allocator, the
    X server's unversioned module name, the DRM output class read-only, nvidia-xconfig, the GTK 3 library."""
    xorg, conf = "/usr/lib/xorg/modules/extensions", "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"
    script = (f"readlink {LIB}/gbm/nvidia-drm_gbm.so; test -f {LIB}/gbm/nvidia-drm_gbm.so && echo gbm-resolves; "
              f"readlink {xorg}/libglxserver_nvidia.so; test -f {xorg}/libglxserver_nvidia.so && echo glx-resolves; "
              f"grep \" {conf} \" /proc/mounts; grep -c nvidia-drm {conf}; /usr/bin/nvidia-xconfig; "
              f"test -f {LIB}/libnvidia-gtk3.so.550.54.14 && echo gtk3-present; echo finished")
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=1", image, "sh", "-c", script],
                          capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "finished" in out, out
    lines = out.splitlines()
    assert "../libnvidia-allocator.so.1" in lines and "gbm-resolves" in lines, out
    assert "libglxserver_nvidia.so.550.54.14" in lines and "glx-resolves" in lines, out
    assert [line for line in lines if line.startswith("/") and f" {conf} " in line and " ro," in line], out
    assert "fixture" in lines and "gtk3-present" in lines, out  # nvidia-xconfig ran from the host's file


def test_a_mig_device_is_its_parent_node_and_capabilities(image: str, installed: None) -> None:
    script = "ls /dev | grep -E '^nvidia[0-9]'; ls /dev/nvidia-caps; cat /dev/nvidia0; echo finished"
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=0:1", image, "sh", "-c", script],
                          capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "finished" in out, out
    listed = [line for line in out.splitlines() if line.startswith("nvidia")]
    assert listed == ["nvidia0", "nvidia-cap2", "nvidia-cap21", "nvidia-cap22"], out
    assert "can't open '/dev/nvidia0': No such device or address" in out  # the cgroup lets it reach the GPU


def test_podman_s_container_gets_the_application_profile_of_its_own_gpus(image: str, installed: None) -> None:
    """The spec's one createContainer hook names both GPUs; podman (on runc) runs it, and the container given
    GPU 1 gets EGLVisibleDGPUDevices 0x2, read-only; given GPU 1 and a MIG device of GPU 0, 0x3."""
    script = f"cat {APPLICATION_PROFILE}; echo; stat -c %a {APPLICATION_PROFILE}; echo finished"
    for devices, minors in ((["nvidia.com/gpu=1"], (1,)), (["nvidia.com/gpu=1", "nvidia.com/gpu=0:1"], (0, 1))):
        flags = [arg for device in devices for arg in ("--device", device)]
        done = subprocess.run([*PODMAN, *flags, image, "sh", "-c", script], capture_output=True, text=True,
                              timeout=180)
        out = done.stdout + done.stderr
        assert "finished" in out, out
        assert out.splitlines()[:2] == [application_profile(minors).decode(), "444"], out


def test_a_read_only_etc_nvidia_leaves_the_container_started_without_the_profile(image: str, installed: None,
                                                                                 tmp_path: Path) -> None:
    """A read-only /etc/nvidia (a ConfigMap there, as NVIDIA's device plugin mounts one) stops the profile,
    not the container: NVIDIA's 1.20.0 hook failed its start (their issue 2026)."""
    config = tmp_path / "etc-nvidia"
    config.mkdir()
    (config / "config").write_text("from a ConfigMap\n")
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=1", "-v", f"{config}:/etc/nvidia:ro", image, "sh",
                           "-c", "ls /etc/nvidia; echo finished"], capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.splitlines() == ["config", "finished"], out
    assert os.listdir(config) == ["config"]


def test_runc_s_oci_hook_writes_the_application_profile_of_the_gpu_it_gives(dgx_specs: Path, tmp_path: Path) -> None:
    bundle = Bundle(tmp_path / "bundle", dgx_specs, tmp_path / "state")
    bundle.save(["cat", APPLICATION_PROFILE], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=1"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout == application_profile((1,)).decode()


def test_runc_ledger_refuses_the_whole_gpu_while_a_mig_instance_is_held(dgx_specs: Path, tmp_path: Path) -> None:
    bundle = Bundle(tmp_path / "bundle", dgx_specs, tmp_path / "state")
    first, second, third = container_name(), container_name(), container_name()
    try:
        bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0:0"})
        assert _start_detached(bundle, first).returncode == 0
        bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0:1"})
        assert bundle.run(second).returncode == 0  # the other instance of the same GPU
        bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=all"})
        refused = bundle.run(third)
        assert refused.returncode != 0 and f"is held by container {first}" in refused.stderr
    finally:
        subprocess.run(["runc", "delete", "-f", first], capture_output=True)
