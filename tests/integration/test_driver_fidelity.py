"""What a real NVIDIA driver install needs in a spec (docs/driver-fidelity.md), on the dgx-a100-mig host:
MIG devices from procfs, libraries by driver version, loader config files, links, IPC, the void env; and the
ledger's view of MIG (each instance its own unit, the whole GPU against all of them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devinject.cdi.model import Spec
from devinject.core.errors import ConfigError, LedgerError
from devinject.discovery.profiles import parse_profile
from devinject.specs.generate import GenerateOptions, generate_specs, write_specs
from tests.conftest import HOSTS

HOST = HOSTS / "dgx-a100-mig"
LIB = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture(scope="module")
def gpu() -> Spec:
    specs = generate_specs(GenerateOptions(root=str(HOST), hook_path="/usr/bin/devinject"))
    return next(s for s in specs if s.kind == "nvidia.com/gpu")


def nodes(spec: Spec, name: str) -> list[tuple[str, int | None]]:
    device = next(d for d in spec.devices if d.name == name)
    return [(n.path, n.minor) for n in device.edits.device_nodes]


def test_a_mig_gpu_is_offered_as_its_instances_only(gpu: Spec) -> None:
    names = [d.name for d in gpu.devices]
    assert names == ["0:0", "0:1", "1", "GPU-a1000000-0000-4000-8000-000000000001", "all"]
    caps = "/dev/nvidia-caps/nvidia-cap"
    assert nodes(gpu, "0:0") == [("/dev/nvidia0", 0), (f"{caps}12", 12), (f"{caps}13", 13), (f"{caps}2", 2)]
    assert nodes(gpu, "0:1") == [("/dev/nvidia0", 0), (f"{caps}21", 21), (f"{caps}22", 22), (f"{caps}2", 2)]
    device = next(d for d in gpu.devices if d.name == "0:0")
    assert {n.major for n in device.edits.device_nodes[1:]} == {235}  # nvidia-caps, from /proc/devices
    assert all(n.file_mode == 0o444 for n in device.edits.device_nodes[1:])  # from the access files
    assert (f"{caps}1", 1) not in nodes(gpu, "all")  # mig/config (0400) is the admin's, never handed out


def test_every_library_of_the_driver_version_and_the_exceptions(gpu: Spec) -> None:
    mounted = {m.container_path for m in gpu.edits.mounts}
    for name in ("libGLX_nvidia.so.550.54.14", "libEGL_nvidia.so.550.54.14", "libnvidia-glcore.so.550.54.14",
                 "libnvidia-rtcore.so.550.54.14", "libnvoptix.so.550.54.14", "libnvidia-ngx.so.550.54.14",
                 "libnvidia-egl-gbm.so.1.1.1", "vdpau/libvdpau_nvidia.so.550.54.14", "libcuda.so.550.54.14"):
        assert f"{LIB}/{name}" in mounted, name
    links = [a for h in gpu.edits.hooks if "--link" in h.args for a in h.args if "::" in a]
    assert f"libcuda.so.1::{LIB}/libcuda.so" in links  # -lcuda for Triton and torch.compile
    assert f"libGLX_nvidia.so.550.54.14::{LIB}/libGLX_nvidia.so.0" in links
    assert f"libGLX_nvidia.so.0::{LIB}/libGLX_indirect.so.0" in links  # declared by the profile
    assert f"libvdpau_nvidia.so.550.54.14::{LIB}/vdpau/libvdpau_nvidia.so.1" in links
    (ldcache,) = [h.args for h in gpu.edits.hooks if "--folder" in h.args]
    assert ldcache[2] == "links-and-ldcache"  # the links and the cache: one hook, one process
    assert ldcache[-10:] == ("--folder", LIB, "--folder", f"{LIB}/vdpau",
                             "--forward-compat", "/usr/local/cuda/compat:libcuda.so:550.54.14",
                             "--application-profile", "/dev/nvidia0", "--application-profile", "/dev/nvidia1")


def test_graphics_as_nvidia_generates_them(gpu: Spec) -> None:
    """docs/driver-fidelity.md: the GBM backend and X server module links, the DRM output class, nvidia-xconfig,
    and the libraries NVIDIA's `*.so.<version>` glob includes (nvidia-settings' GTK 3 and Wayland clients)."""
    links = [a for h in gpu.edits.hooks if "--link" in h.args for a in h.args if "::" in a]
    xorg = "/usr/lib/xorg/modules/extensions"
    for link in (f"../libnvidia-allocator.so.1::{LIB}/gbm/nvidia-drm_gbm.so",  # as graphics.go makes it
                 f"libglxserver_nvidia.so.550.54.14::{xorg}/libglxserver_nvidia.so",
                 f"libnvidia-vulkan-producer.so.550.54.14::{LIB}/libnvidia-vulkan-producer.so"):
        assert link in links, link
    mounts = {m.container_path: m for m in gpu.edits.mounts}
    conf = mounts["/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"]
    assert conf.host_path == f"{HOST}/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf" and "ro" in conf.options
    assert "ro" in mounts["/usr/bin/nvidia-xconfig"].options
    for name in ("libnvidia-gtk3.so.550.54.14", "libnvidia-wayland-client.so.550.54.14",
                 "libnvidia-vulkan-producer.so.550.54.14"):
        assert f"{LIB}/{name}" in mounts, name


def test_a_declared_link_waits_for_its_target(host_copy) -> None:  # type: ignore[no-untyped-def]
    """No allocator, no GBM link; no driver version known, no link to a versioned name."""
    root = host_copy("dgx-a100-mig")
    for name in ("libnvidia-allocator.so.1", "libnvidia-allocator.so", "libnvidia-allocator.so.550.54.14"):
        (root / LIB.lstrip("/") / name).unlink()
    (spec,) = generate_specs(GenerateOptions(root=str(root), hook_path="/usr/bin/devinject",
                                             kinds=("nvidia.com/gpu",)))
    args = [a for h in spec.edits.hooks for a in h.args]
    assert not [a for a in args if "nvidia-drm_gbm" in a]
    assert "libglxserver_nvidia.so.550.54.14::/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so" in args


OLD = "535.161.08"  # the driver an upgrade left files of (tests/fixtures/build_hosts.nvidia_leftovers)


def _old_driver_files(spec: Spec) -> list[str]:
    """Every mount and hook argument of `spec` that names a file of the old driver."""
    mounts = [f"{m.container_path} <- {m.host_path}" for m in spec.edits.mounts]
    args = [a for h in spec.edits.hooks for a in h.args]
    return [x for x in mounts + args if OLD in x or "libnvidia-egl-wayland.so.1.1.11" in x]


def test_only_the_running_drivers_files_when_an_upgrade_left_the_old_ones(gpu: Spec) -> None:
    """The old driver's libnvidia-gpucomp and libnvidia-pkcs11* (their SONAMEs are their versioned names,
    so ld.so.cache lists both versions), its libcuda, VDPAU, firmware and X.Org module, and an EGL platform
    library of an older version of its own are left on the host: none of them goes into the spec."""
    assert _old_driver_files(gpu) == []
    mounted = {m.container_path for m in gpu.edits.mounts}
    for name in ("libnvidia-gpucomp.so.550.54.14", "libnvidia-pkcs11.so.550.54.14",
                 "libnvidia-pkcs11-openssl3.so.550.54.14", "libnvidia-egl-wayland.so.1.1.13"):
        assert f"{LIB}/{name}" in mounted, name


def test_the_running_version_from_the_module_or_libcuda_when_procfs_has_none(host_copy) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("dgx-a100-mig")
    (root / "proc/driver/nvidia/version").unlink()
    options = {"root": str(root), "hook_path": "/usr/bin/devinject", "kinds": ("nvidia.com/gpu",)}
    (by_module,) = generate_specs(GenerateOptions(**options))  # type: ignore[arg-type]
    (root / "sys/module/nvidia/version").unlink()
    (by_libcuda,) = generate_specs(GenerateOptions(**options))  # type: ignore[arg-type]  # libcuda.so.1's target
    for spec in (by_module, by_libcuda):
        assert _old_driver_files(spec) == []
        assert f"{LIB}/libnvidia-gpucomp.so.550.54.14" in {m.container_path for m in spec.edits.mounts}


def test_loader_files_land_where_loaders_look(gpu: Spec) -> None:
    mounts = {m.container_path: m for m in gpu.edits.mounts}
    icd = mounts["/etc/vulkan/icd.d/nvidia_icd.json"]
    assert icd.host_path == f"{HOST}/usr/share/vulkan/icd.d/nvidia_icd.json" and "ro" in icd.options
    assert mounts["/etc/OpenCL/vendors/nvidia.icd"].host_path == f"{HOST}/etc/OpenCL/vendors/nvidia.icd"
    for path in ("/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "/usr/share/nvidia/nvoptix.bin",
                 "/etc/vulkan/implicit_layer.d/nvidia_layers.json",
                 "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json"):
        assert path in mounts, path
    assert "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json" not in mounts  # absent on the host
    assert {"/usr/share/X11/xorg.conf.d/10-nvidia.conf", "/usr/lib/xorg/modules/drivers/nvidia_drv.so",
            "/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.550.54.14"} <= set(mounts)
    mps = mounts["/tmp/nvidia-mps"]
    assert "ro" not in mps.options and "rbind" in mps.options and "noexec" in mps.options  # clients write pipes
    assert {"/usr/bin/nvidia-imex", "/usr/bin/nvidia-imex-ctl"} <= set(mounts)
    assert gpu.edits.env == ("NVIDIA_VISIBLE_DEVICES=void",)
    assert gpu.cdi_version == "0.5.0"


def test_profile_fields_are_checked() -> None:
    base = {"name": "x", "kind": "a.com/b"}
    with pytest.raises(ConfigError, match=r"partitions.type: 'amd-xcp' unknown"):
        parse_profile({**base, "partitions": {"type": "amd-xcp", "source": "/p", "node": "/dev/x{minor}",
                                              "region": "r"}}, "p.yaml")
    with pytest.raises(ConfigError, match=r"partitions.node: a /dev path with \{minor\}"):
        parse_profile({**base, "partitions": {"type": "amd-kfd", "source": "/p", "node": "/dev/x",
                                              "region": "r"}}, "p.yaml")
    for link, target in (("../a", "c"), ("/a", "c"), ("a//b", "c"), ("a/./b", "c"), ("a", "b/c")):
        with pytest.raises(ConfigError, match=rf"links: {link!r}: the target is a mounted file's name"):
            parse_profile({**base, "links": {link: target}}, "p.yaml")
    assert parse_profile({**base, "links": {"gbm/x.so": "liby.so.{driver_version}"}}, "p.yaml").links == (
        ("gbm/x.so", "liby.so.{driver_version}"),)
    with pytest.raises(ConfigError, match=r"driver-libraries.patterns: required"):
        parse_profile({**base, "driver-libraries": {"anchor": "libx.so.1"}}, "p.yaml")
    with pytest.raises(ConfigError, match=r"config-files\[0\]: paths must be absolute"):
        parse_profile({**base, "config-files": [{"container": "etc/x.json"}]}, "p.yaml")


def test_ledger_mig_instances_are_units_and_the_whole_gpu_conflicts_with_them(gpu: Spec, tmp_path: Path) -> None:
    from devinject.hook.main import HookOptions, HostParts

    specs = generate_specs(GenerateOptions(root=str(HOST), hook_path="/usr/bin/devinject"))
    write_specs(specs, tmp_path / "cdi", "yaml")
    (tmp_path / "cdi" / "other.yaml").write_text(  # another tool's spec offering the same GPU whole
        "cdiVersion: 0.5.0\nkind: example.com/gpu\ndevices:\n- name: whole\n  containerEdits:\n    deviceNodes:\n"
        f"    - {{path: /dev/nvidia0, hostPath: {HOST}/dev/nvidia0, type: c, major: 195, minor: 0}}\n")
    opts = HookOptions()
    opts.spec_dirs, opts.state_dir = (str(tmp_path / "cdi"),), str(tmp_path / "state")

    def book(container: str, *names: str) -> None:
        parts = HostParts(opts)
        parts.book(container, os.getpid(), parts.resolve(names))

    book("a", "nvidia.com/gpu=0:0")
    book("b", "nvidia.com/gpu=0:1")  # the other instance of the same GPU
    with pytest.raises(LedgerError, match="held by container a"):
        book("c", "nvidia.com/gpu=0:0")  # an instance is exclusive
    with pytest.raises(LedgerError, match="c 195:0 is held by container a"):
        book("d", "example.com/gpu=whole")  # the whole GPU while its instances are held
    with pytest.raises(LedgerError):
        book("e", "nvidia.com/gpu=all")
    book("f", "nvidia.com/gpu=1")  # the other GPU is free


def test_group_only_nodes_get_their_group_and_additional_gids_when_the_cap_allows(host_copy, caplog) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e.conftest import require

    require(os.geteuid() == 0, "needs root (mknod, chown)")
    root = host_copy("workstation")
    for name, minor, gid in (("card1", 1, 44), ("renderD129", 129, 107)):  # video, render
        node = root / "dev/dri" / name
        node.unlink()
        os.mknod(node, 0o020660, os.makedev(226, minor))
        os.chown(node, 0, gid)
    options = {"root": str(root), "hook_path": "/usr/bin/devinject", "kinds": ("nvidia.com/gpu",)}
    (old,) = generate_specs(GenerateOptions(**options))  # type: ignore[arg-type]
    device = next(d for d in old.devices if d.name == "0")
    assert {n.path: n.gid for n in device.edits.device_nodes} == {
        "/dev/nvidia0": None, "/dev/dri/card1": 44, "/dev/dri/renderD129": 107}
    assert not device.edits.additional_gids and old.cdi_version == "0.5.0"
    assert "--group-add 44,107" in caplog.text and "above the --cdi-version cap 0.5.0" in caplog.text
    (new,) = generate_specs(GenerateOptions(**options, version_cap="0.7.0"))  # type: ignore[arg-type]
    assert next(d for d in new.devices if d.name == "0").edits.additional_gids == (44, 107)
    assert next(d for d in new.devices if d.name == "all").edits.additional_gids == (44, 107)
    assert new.cdi_version == "0.7.0"


def test_amd_compute_partitions_are_offered_as_their_render_nodes() -> None:
    """MI300X in CPX mode: one KFD node per partition (location_id low bits), each with its render node;
    partitions 1..7 are platform devices, so the PCI function's own drm directory has only the first."""
    (amd,) = generate_specs(GenerateOptions(root=str(HOSTS / "mi300x"), hook_path="/usr/bin/devinject",
                                            kinds=("amd.com/gpu",)))
    names = [d.name for d in amd.devices]
    assert names[:2] == ["0", "0000:05:00.0"] and "7" not in names and "0000:e5:00.0" not in names
    assert [n for n in names if n.startswith("7:")] == [f"7:{j}" for j in range(8)]
    assert nodes(amd, "7:0") == [("/dev/dri/renderD135", 135)]
    assert nodes(amd, "7:7") == [("/dev/dri/renderD142", 142)]
    assert nodes(amd, "6") == [("/dev/dri/card7", 7), ("/dev/dri/renderD134", 134)]  # SPX: whole
    assert "/dev/kfd" in [n.path for n in amd.edits.device_nodes]  # every partition needs it


def test_imex_channels_are_their_own_kind(host_copy) -> None:  # type: ignore[no-untyped-def]
    specs = {s.kind: s for s in generate_specs(GenerateOptions(root=str(HOST), hook_path="/usr/bin/devinject"))}
    imex = specs["nvidia.com/imex-channel"]
    assert [d.name for d in imex.devices] == ["0", "1", "all"]
    assert nodes(imex, "1") == [("/dev/nvidia-caps-imex-channels/channel1", 1)]
    assert {n.major for d in imex.devices for n in d.edits.device_nodes} == {233}  # from /proc/devices
    hgx = generate_specs(GenerateOptions(root=str(HOSTS / "hgx-h100"), hook_path="/usr/bin/devinject"))
    assert "nvidia.com/imex-channel" not in {s.kind for s in hgx}  # no channels there: no spec, no PCI match
    copy = host_copy("dgx-a100-mig")
    devices = (copy / "proc/devices").read_text().replace("233 nvidia-caps-imex-channels\n", "")
    (copy / "proc/devices").write_text(devices)  # the module is not loaded: nodes left behind are no devices
    assert "nvidia.com/imex-channel" not in {s.kind for s in generate_specs(
        GenerateOptions(root=str(copy), hook_path="/usr/bin/devinject"))}
    with pytest.raises(ConfigError, match="matches no PCI function"):
        parse_profile({"name": "x", "kind": "a.com/b", "match": {"vendor": ["10de"]},
                       "channels": {"directory": "/dev/x", "prefix": "c", "region": "x"}}, "p.yaml")


def test_partition_keys_name_the_partition_stably() -> None:
    """The device plugin's IDs for partitions: `<address>-<key>`, by GPU/compute instance for MIG."""
    from devinject.discovery.discover import discover
    from devinject.discovery.host import Host
    from devinject.discovery.profiles import load_profiles

    keys = {}
    for name in ("dgx-a100-mig", "mi300x"):
        host = Host(str(HOSTS / name))
        keys.update({f"{f.address}-{p.key}": p.name for f in discover(host, load_profiles(host)) for p in f.partitions})
    assert keys["0000:07:00.0-gi2-ci0"] == "0:1" and keys["0000:e5:00.0-part7"] == "7:7"
    assert len(keys) == 2 + 8
