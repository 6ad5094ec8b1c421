"""`devinject hook` as a real runc prestart hook, cgroup v1 and v2."""

from __future__ import annotations

import os

import pytest

from devinject.linux.ldcache import parse_ldcache
from tests.e2e.conftest import Bundle, container_name

pytestmark = pytest.mark.live

CHECK = ("cat /dev/nvidia0; mknod /dev/unrequested c 195 1 && cat /dev/unrequested; "
         "grep libcuda /proc/mounts; readlink /dev/dri/by-path/pci-0000:01:00.0-card; "
         "readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1; echo finished")


@pytest.mark.parametrize("v2", [False, True], ids=["cgroup-v1", "cgroup-v2-ebpf"])
def test_requested_device_reaches_driver_unrequested_stays_denied(bundle: Bundle, v2: bool) -> None:
    bundle.save(["sh", "-c", CHECK], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name(), v2=v2)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "can't open '/dev/nvidia0': No such device or address" in out  # cgroup let us reach the "driver"
    assert "can't open '/dev/unrequested': Operation not permitted" in out  # device cgroup still denies
    assert " ro,nosuid,nodev" in out and "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14" in out
    assert "\n../card1\n" in out  # the GPU's DRM by-path link (the spec's hook's --device-link, run inline)
    assert "libcuda.so.550.54.14" in out.split("finished")[0].splitlines()[-1]
    cache = {e.soname: e.path for e in parse_ldcache((bundle.rootfs / "etc/ld.so.cache").read_bytes())}
    assert cache["libcuda.so.1"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert record["result"] == "ok" and str(record["cgroup"]).startswith("v2" if v2 else "v1")


def test_env_request_through_nvidia_visible_devices_when_the_admin_allows_it(bundle: Bundle) -> None:
    bundle.config["hooks"]["prestart"][0]["args"].append("--env-requests")
    bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0"], env=["NVIDIA_VISIBLE_DEVICES=all"])
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "c3:0"


@pytest.mark.parametrize("env", ["NVIDIA_VISIBLE_DEVICES=all", "DEVINJECT_DEVICES=nvidia.com/gpu=0"])
def test_env_requests_from_the_image_are_ignored_by_default(bundle: Bundle, env: str) -> None:
    bundle.save(["sh", "-c", "ls /dev/nvidia0 || echo absent"], env=[env])
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert "absent" in done.stdout
    assert not (bundle.rootfs / "usr").exists()


def test_no_request_touches_nothing(bundle: Bundle) -> None:
    bundle.save(["sh", "-c", "ls /dev/nvidia0 || echo absent"])
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert "absent" in done.stdout
    assert not (bundle.rootfs / "usr").exists()
    assert bundle.log_records() == []


def test_unknown_device_fails_before_touching_anything(bundle: Bundle) -> None:
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0,nvidia.com/gpu=9"})
    before = sorted(p.relative_to(bundle.rootfs) for p in bundle.rootfs.rglob("*"))
    done = bundle.run(container_name())
    assert done.returncode != 0
    assert "devinject: error: unresolvable CDI device nvidia.com/gpu=9: nvidia.com/gpu offers 0," in done.stderr
    assert sorted(p.relative_to(bundle.rootfs) for p in bundle.rootfs.rglob("*")) == before


def test_failure_midway_rolls_back_nodes_mounts_and_dirs(bundle: Bundle, tmp_path) -> None:
    spec = tmp_path / "broken-cdi"
    spec.mkdir()
    missing = tmp_path / "vanished.so"
    lib = tmp_path / "present.so"
    lib.write_bytes(b"\x7fELF")
    (spec / "broken.yaml").write_text(
        "cdiVersion: 0.5.0\nkind: example.com/dev\ndevices:\n- name: a\n  containerEdits:\n"
        "    deviceNodes: [{path: /dev/example0, type: c, major: 195, minor: 0}]\ncontainerEdits:\n  mounts:\n"
        f"  - {{hostPath: {lib}, containerPath: /opt/vendor/lib/present.so, options: [ro, bind]}}\n"
        f"  - {{hostPath: {missing}, containerPath: /opt/vendor/lib/z/vanished.so, options: [ro, bind]}}\n")
    bundle.use_spec_dir(spec)
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "example.com/dev=a"})
    done = bundle.run(container_name())
    assert done.returncode != 0
    assert f"mount source {missing}" in done.stderr
    assert not (bundle.rootfs / "opt").exists()


@pytest.mark.parametrize("v2", [False, True], ids=["cgroup-v1", "cgroup-v2-ebpf"])
def test_prestart_and_create_runtime_both_configured_stack_nothing(bundle: Bundle, v2: bool) -> None:
    """The same hook in two pre-pivot stages: the second run finds everything in place (and on cgroup v2
    replaces its own eBPF prefix instead of stacking a second one: the device still opens)."""
    bundle.config["hooks"]["createRuntime"] = [bundle.config["hooks"]["prestart"][0]]
    count = ("grep -c libcuda.so.550.54.14 /proc/self/mountinfo; grep -c nvidia0 /proc/self/mountinfo; "
             "cat /dev/nvidia0; true")
    bundle.save(["sh", "-c", count],
                annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name(), v2=v2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0"]  # one mount, and the node was made, not mounted
    assert "No such device or address" in done.stderr
    runs = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert len(runs) == 2 and all(r["result"] == "ok" for r in runs)
    assert any("present" in step for step in runs[1]["steps"])


def test_hostile_image_symlinks_never_lead_outside_the_rootfs(bundle: Bundle, tmp_path) -> None:
    outside = tmp_path / "host-side"
    outside.mkdir()
    (bundle.rootfs / "usr" / "lib").mkdir(parents=True)
    (bundle.rootfs / "usr" / "lib" / "x86_64-linux-gnu").symlink_to(str(outside))  # absolute host path
    (bundle.rootfs / "lib").symlink_to("../../../../../../..")
    (bundle.rootfs / "usr" / "bin").symlink_to("/../../..")
    bundle.save(["sh", "-c", "readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1"],
                annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert list(outside.iterdir()) == []  # nothing created or mounted on the host side
    inside = bundle.rootfs / str(outside).lstrip("/")
    assert (inside / "libcuda.so.1").is_symlink()  # the links landed inside the rootfs instead
    # /lib -> ../../.. and /usr/bin -> /../../.. both resolve to the rootfs itself
    assert (bundle.rootfs / "firmware/nvidia/550.54.14/gsp_ga10x.bin").is_file()
    assert (bundle.rootfs / "nvidia-smi").is_file()
    assert not os.path.exists("/firmware") and not os.path.exists("/nvidia-smi")


@pytest.mark.parametrize(("compat_version", "wins"), [("560.35.03", True), ("545.23.08", False)],
                         ids=["newer-compat-first", "older-compat-ignored"])
def test_cuda_forward_compat_libraries_in_the_image_come_first_when_newer(bundle: Bundle, compat_version: str,
                                                                          wins: bool) -> None:
    """The host driver is 550.54.14; an image carrying /usr/local/cuda/compat/libcuda.so.<version> gets that
    directory first in its linker cache when the version is newer, and the host's libcuda otherwise."""
    from tests.fixtures.build_hosts import LibBuilder

    compat = bundle.rootfs / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    builder = LibBuilder()
    try:
        (compat / f"libcuda.so.{compat_version}").write_bytes(builder.build("libcuda.so.1"))
    finally:
        import shutil

        shutil.rmtree(builder.tmp, ignore_errors=True)
    (compat / "libcuda.so.1").symlink_to(f"libcuda.so.{compat_version}")
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    cache = [e.path for e in parse_ldcache((bundle.rootfs / "etc/ld.so.cache").read_bytes())
             if e.soname == "libcuda.so.1"]
    first = "/usr/local/cuda/compat/libcuda.so.1" if wins else "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert cache[0] == first, cache
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert any("forward compat" in step for step in record["steps"]) == wins
