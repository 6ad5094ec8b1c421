"""The driver's application profile (NVIDIA's EGLVisibleDGPUDevices) for the container's GPUs: the hook's file,
byte for byte as NVIDIA's `nvidia-cdi-hook update-application-profile` writes it (compared with the real one in
tests/e2e/test_application_profile_live.py), for the GPUs the container was given only, written inside the
rootfs whatever the image's links say; and the spec's hook asks for it only where the driver's EGL or Vulkan
is mounted to read it."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from devinject.cdi.model import ContainerEdits, DeviceNode, Hook
from devinject.core.errors import ConfigError
from devinject.discovery.profiles import parse_profile
from devinject.hook.cdihook import run_cdi_hook
from devinject.hook.plan import APPLICATION_PROFILE, application_profile, gpu_minors, parse_cdi_hook, plan
from devinject.specs.generate import GenerateOptions, generate_specs
from devinject.specs.hooks import HookCommand, library_hook
from tests.conftest import HOSTS
from tests.unit import test_dra_prepare_edits
from tests.unit.test_hook_plan import _cdi_hook_container

reads = test_dra_prepare_edits.reads  # the fixture: each read of the driver's files

PROFILE = APPLICATION_PROFILE.lstrip("/")
GPUS = ("--application-profile", "/dev/nvidia0", "--application-profile", "/dev/nvidia3",
        "--application-profile", "/dev/nvidia5")


def test_the_file_is_nvidias_bytes_with_a_bit_per_gpu_minor():
    assert application_profile((0, 3)) == (
        b'{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",0x9]}],'
        b'"rules":[{"pattern":[],"profile":"_container_"}]}')
    assert b",0x8000000000000001]" in application_profile((63, 0, 63))


def test_the_gpus_are_those_named_and_given_and_a_mask_holds_minors_0_to_63():
    given = {"/dev/nvidia3": 3, "/dev/nvidiactl": 255, "/dev/nvidia64": 64, "/dev/dri/card1": 1}
    minors, dropped = gpu_minors(["/dev/nvidia0", "/dev/nvidia3", "/dev//nvidia64", "dev/nvidia3"], given)
    assert minors == (3,)  # nvidia0 is not the container's; nvidiactl and the DRM node are not named
    assert dropped == ("application profile: GPU minor 64 left out (EGLVisibleDGPUDevices holds minors 0-63)",)


def test_the_flag_belongs_to_its_own_subcommand_and_the_combined_one_only():
    assert parse_cdi_hook(["update-application-profile", *GPUS])[1]["--application-profile"] == list(GPUS[1::2])
    assert parse_cdi_hook(["links-and-ldcache", "--folder", "/l", *GPUS[:2]])[1]["--application-profile"] == [
        "/dev/nvidia0"]
    from devinject.core.errors import HookError

    for single in ("create-symlinks", "update-ldcache"):
        with pytest.raises(HookError, match="unexpected argument '--application-profile'"):
            parse_cdi_hook([single, *GPUS[:2]])


def test_the_oci_hook_writes_the_profile_of_the_gpus_it_gives():
    hook = Hook("createContainer", "/usr/bin/devinject", ("devinject", "cdi-hook", "links-and-ldcache",
                                                          "--folder", "/usr/lib", *GPUS))
    given = (DeviceNode("/dev/nvidia3", type="c", major=195, minor=3), DeviceNode("/dev/nvidiactl", type="c",
                                                                                  major=195, minor=255))
    assert plan(ContainerEdits(device_nodes=given, hooks=(hook,))).gpu_minors == (3,)
    assert plan(ContainerEdits(hooks=(hook,))).gpu_minors == ()  # no GPU given: no file


def _run(tmp_path: Path, devices: dict[str, int], *args: str) -> tuple[Path, list[str]]:
    rootfs, stdin = _cdi_hook_container(tmp_path, devices)
    try:
        return rootfs, run_cdi_hook(list(args), stdin)
    finally:
        os.close(stdin)


def test_a_cdi_hook_writes_the_profile_of_the_container_s_gpus_as_nvidia_makes_it(tmp_path):
    rootfs, log = _run(tmp_path, {"/dev/nvidia3": 3, "/dev/nvidia5": 5, "/dev/nvidiactl": 255},
                       "update-application-profile", *GPUS)
    written = rootfs / PROFILE
    assert written.read_bytes() == application_profile((3, 5))
    assert log == [f"application profile {APPLICATION_PROFILE}: EGLVisibleDGPUDevices 0x28"]
    modes = [stat.S_IMODE(p.stat().st_mode) for p in (written, written.parent, written.parent.parent)]
    assert modes == [0o444, 0o555, 0o555]
    assert stat.S_IMODE((rootfs / "etc").stat().st_mode) != 0o555  # the image's /etc as it was


def test_a_container_given_none_of_the_gpus_gets_no_profile(tmp_path):
    rootfs, log = _run(tmp_path, {"/dev/nvidia1": 1, "/dev/nvidiactl": 255}, "update-application-profile", *GPUS)
    assert log == [] and not (rootfs / "etc/nvidia").exists()


def test_the_image_s_links_are_followed_inside_its_rootfs_never_out_of_it(tmp_path):
    """Everything in an image is hostile: its /etc/nvidia, an absolute link to a host directory, leads to that
    path inside the rootfs; its own 10-container.conf, a link to a host file, is replaced, not written
    through."""
    outside = tmp_path / "host-etc-nvidia"
    (outside / "nvidia-application-profiles-rc.d").mkdir(parents=True)
    host_file = tmp_path / "host-file"
    host_file.write_text("host's own\n")
    (outside / "nvidia-application-profiles-rc.d" / "10-container.conf").symlink_to(host_file)
    rootfs = tmp_path / "bundle" / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/nvidia").symlink_to(outside)
    rootfs, _ = _run(tmp_path, {"/dev/nvidia0": 0}, "update-application-profile", *GPUS)
    assert host_file.read_text() == "host's own\n"
    assert os.listdir(outside / "nvidia-application-profiles-rc.d") == ["10-container.conf"]
    inside = rootfs / str(outside).lstrip("/") / "nvidia-application-profiles-rc.d/10-container.conf"
    assert inside.read_bytes() == application_profile((0,))
    (rootfs / "etc/nvidia").unlink()  # and a link in the image at the file's own path
    (rootfs / "etc/nvidia/nvidia-application-profiles-rc.d").mkdir(parents=True)
    (rootfs / PROFILE).symlink_to(host_file)
    (rootfs / "dev/dri").rmdir()  # made again by the next container's bundle
    _run(tmp_path, {"/dev/nvidia3": 3}, "update-application-profile", *GPUS)
    assert host_file.read_text() == "host's own\n"
    assert not (rootfs / PROFILE).is_symlink() and (rootfs / PROFILE).read_bytes() == application_profile((3,))


def test_a_read_only_etc_leaves_the_container_without_the_profile_not_unstarted(tmp_path, monkeypatch):
    """NVIDIA's 1.20.0 hook failed the container when /etc/nvidia was read-only (a ConfigMap there; their
    issue 2026, fixed by ignoring it): devinject says so and goes on."""
    from devinject.core import atomicfile

    def read_only(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(atomicfile, "replace_at", read_only)
    rootfs, log = _run(tmp_path, {"/dev/nvidia0": 0}, "update-application-profile", *GPUS)
    assert log == [f"application profile {APPLICATION_PROFILE}: EGLVisibleDGPUDevices 0x1; "
                   "not written: read-only file system"]
    assert not (rootfs / PROFILE).exists()


def test_a_failed_later_step_takes_the_profile_back(tmp_path):
    rootfs = tmp_path / "bundle" / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    (rootfs / "usr/lib").write_text("a file where the linker cache's folder should be")
    (rootfs / "etc").mkdir()
    (rootfs / "etc/ld.so.cache").mkdir()  # the linker cache cannot be written: the hook fails
    from devinject.core.errors import HookError

    with pytest.raises(HookError):
        _run(tmp_path, {"/dev/nvidia0": 0}, "links-and-ldcache", "--folder", "/usr/lib", *GPUS)
    assert not (rootfs / "etc/nvidia").exists()


def _gpu_hook_args(root: Path) -> list[str]:
    spec = {s.kind: s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/usr/bin/devinject"))}
    (hook,) = spec["nvidia.com/gpu"].edits.hooks
    return list(hook.args)


def _profiled(args: list[str]) -> list[str]:
    return [value for flag, value in itertools.pairwise(args) if flag == "--application-profile"]


def test_generate_asks_for_it_where_the_driver_ships_egl_or_vulkan_only(tmp_path):
    """The dgx-a100-mig host ships the EGL vendor file and the Vulkan ICD: the spec's one hook names both
    GPUs (GPU 0 is offered as its MIG devices, whose parent node it is); hgx-h100, compute only, gets none
    until a copy of it has the Vulkan ICD."""
    dgx = _gpu_hook_args(HOSTS / "dgx-a100-mig")
    assert dgx[2] == "links-and-ldcache" and _profiled(dgx) == ["/dev/nvidia0", "/dev/nvidia1"]
    assert _profiled(_gpu_hook_args(HOSTS / "hgx-h100")) == []
    host = tmp_path / "hgx"
    shutil.copytree(HOSTS / "hgx-h100", host, symlinks=True)
    icd = host / "usr/share/vulkan/icd.d/nvidia_icd.json"
    icd.parent.mkdir(parents=True)
    icd.write_text(json.dumps({"file_format_version": "1.0.0", "ICD": {"library_path": "libGLX_nvidia.so.0"}}))
    assert sorted(_profiled(_gpu_hook_args(host))) == sorted(f"/dev/nvidia{m}" for m in range(8))
    copy = tmp_path / "dgx"
    shutil.copytree(HOSTS / "dgx-a100-mig", copy, symlinks=True)
    for path in ("usr/share/vulkan/icd.d/nvidia_icd.json", "usr/share/glvnd/egl_vendor.d/10_nvidia.json"):
        (copy / path).unlink()
    assert _profiled(_gpu_hook_args(copy)) == []


def test_only_the_profile_to_write_is_its_own_subcommand():
    command = HookCommand("/usr/bin/devinject", ("devinject",))
    (hook,) = library_hook(command, [], [], [], (), ("/dev/nvidia0",))
    assert hook.args == ("devinject", "cdi-hook", "update-application-profile", "--application-profile",
                         "/dev/nvidia0")
    (both,) = library_hook(command, ["a::/l"], [], [], (), ("/dev/nvidia0",))
    assert both.args[2] == "links-and-ldcache"


def test_the_profile_key_names_a_gpu_node_by_its_minor():
    head = {"name": "x", "kind": "a.com/b"}
    rule = parse_profile({**head, "application-profile": {"gpu-node": "/dev/nvidia{minor}", "needs": [
        "/etc/vulkan/icd.d/nvidia_icd.json"]}}, "x.yaml").application_profile
    assert rule is not None
    paths = ("/dev/nvidia3", "/dev/nvidia12", "/dev/nvidiactl", "/dev/nvidia", "/dev/nvidia-caps/x1", "/dev/dri/card1")
    assert [p for p in paths if rule.names_gpu(p)] == ["/dev/nvidia3", "/dev/nvidia12"]
    with pytest.raises(ConfigError, match=r"x\.yaml\.application-profile\.gpu-node: a /dev path with \{minor\}"):
        parse_profile({**head, "application-profile": {"gpu-node": "/dev/x", "needs": ["/a"]}}, "x.yaml")


def test_a_spec_per_claim_names_its_own_gpus_from_the_driver_files_read_once(reads):
    """The DRA driver builds a spec per claim (its devices only) through EditsMemo: each claim's hook names
    its own GPUs, and the driver's files are read for the first claim only, whichever GPUs the next asks."""
    from devinject.discovery.node import Node
    from devinject.specs.generate import EditsMemo, build_specs, served_devices

    opts = GenerateOptions(root=str(HOSTS / "dgx-a100-mig"), hook_path="/usr/bin/devinject",
                           kinds=("nvidia.com/gpu",))
    node = Node(opts.root, check=False)
    profiles, found = served_devices(node, opts)
    memo = EditsMemo()
    for item in found:
        (spec,) = build_specs(node.host, profiles, [item], opts, node.view, memo)
        (hook,) = spec.edits.hooks
        assert _profiled(list(hook.args)) == [f"/dev/nvidia{item.index}"]
    assert len(found) == 2 and reads == ["nvidia-gpu"]
