import itertools
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from devinject.cdi.cdiversion import required_version
from devinject.cdi.model import ContainerEdits, Device, DeviceNode, Spec
from devinject.cdi.spec import load_file
from devinject.core.errors import ConfigError, DevinjectError, SpecError
from devinject.specs.generate import GenerateOptions, generate_specs, render, write_specs
from tests.conftest import HOSTS

HOOK = "/usr/bin/devinject"


def _specs(name, **kw):
    return {s.kind: s for s in generate_specs(GenerateOptions(root=str(HOSTS / name), hook_path=HOOK, **kw))}


def test_default_names_are_index_and_uuid_plus_all():
    gpu = _specs("hgx-h100")["nvidia.com/gpu"]
    names = [d.name for d in gpu.devices]
    assert names[:2] == ["0", "GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00"]
    assert names[-1] == "all" and len(names) == 17


def test_index_and_pci_where_no_uuid():
    names = [d.name for d in _specs("mi300x")["amd.com/gpu"].devices]
    assert names[:2] == ["0", "0000:05:00.0"]


def test_every_name_of_a_device_has_identical_edits():
    gpu = _specs("hgx-h100", strategies=("index", "uuid", "pci"))["nvidia.com/gpu"]
    assert gpu.device("0").edits == gpu.device("GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00").edits == gpu.device(
        "0000:18:00.0").edits


def test_all_device_merges_every_device():
    gpu = _specs("hgx-h100")["nvidia.com/gpu"]
    assert sorted(n.minor for n in gpu.device("all").edits.device_nodes) == list(range(8))


def test_host_paths_carry_the_root_container_paths_do_not():
    root = str(HOSTS / "hgx-h100")
    gpu = _specs("hgx-h100")["nvidia.com/gpu"]
    node = gpu.device("0").edits.device_nodes[0]
    assert (node.path, node.host_path) == ("/dev/nvidia2", root + "/dev/nvidia2")
    cuda = next(m for m in gpu.edits.mounts if "libcuda" in m.container_path)
    assert cuda.container_path == "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"
    assert cuda.host_path == root + cuda.container_path
    assert cuda.options == ("ro", "nosuid", "nodev", "bind")


def test_soname_links_and_ldcache_hooks_are_generated():
    hooks = _specs("hgx-h100")["nvidia.com/gpu"].edits.hooks
    assert [h.args[2] for h in hooks] == ["links-and-ldcache"]  # one process per container for both
    assert "libcuda.so.550.54.14::/usr/lib/x86_64-linux-gnu/libcuda.so.1" in hooks[0].args
    assert hooks[0].args[-4:] == ("--folder", "/usr/lib/x86_64-linux-gnu",
                                  "--forward-compat", "/usr/local/cuda/compat:libcuda.so:550.54.14")
    assert all(h.path == HOOK and h.hook_name == "createContainer" and h.env for h in hooks)


def test_firmware_follows_driver_version():
    mounts = [m.container_path for m in _specs("hgx-h100")["nvidia.com/gpu"].edits.mounts]
    assert "/lib/firmware/nvidia/550.54.14/gsp_ga10x.bin" in mounts


def test_control_nodes_use_proc_devices_majors():
    nodes = {n.path: (n.major, n.minor) for n in _specs("hgx-h100")["nvidia.com/gpu"].edits.device_nodes}
    assert nodes == {"/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (510, 0), "/dev/nvidia-uvm-tools": (510, 1),
                     "/dev/nvidia-modeset": (195, 254)}


def test_version_is_lowest_that_fits():
    spec = Spec("a.com/b", (Device("gpu-a", ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="c", major=1,
                                                                                    minor=2),))),))
    assert required_version(spec) == "0.3.0"
    digit = Spec("a.com/b", (Device("0", spec.devices[0].edits),))
    assert required_version(digit) == "0.5.0"
    assert _specs("hgx-h100")["nvidia.com/gpu"].cdi_version == "0.5.0"


def test_uuid_only_names_at_root_slash_would_need_no_more_than_cap():
    with pytest.raises(SpecError, match=r"needs CDI 0\.5\.0, above the --cdi-version cap 0\.4\.0"):
        _specs("hgx-h100", version_cap="0.4.0")


def test_unknown_strategy_and_kind_are_config_errors():
    with pytest.raises(ConfigError, match="--device-name-strategy"):
        _specs("hgx-h100", strategies=("serial",))
    with pytest.raises(ConfigError, match=r"--kind: no profile offers 'acme\.com/x'"):
        _specs("hgx-h100", kinds=("acme.com/x",))


def test_written_specs_are_valid_0644_and_byte_identical(tmp_path):
    specs = list(_specs("hgx-h100").values())
    first = write_specs(specs, tmp_path / "cdi", "yaml")
    contents = {p: p.read_bytes() for p in first}
    again = write_specs(list(_specs("hgx-h100").values()), tmp_path / "cdi", "yaml")
    assert {p: p.read_bytes() for p in again} == contents
    for path in first:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
        assert load_file(path).kind in ("nvidia.com/gpu", "nvidia.com/rdma")
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == ["nvidia.com-gpu.yaml", "nvidia.com-rdma.yaml"]


def test_invalid_spec_is_never_written(tmp_path):
    bad = Spec("a.com/b", (Device("x", ContainerEdits()),))
    with pytest.raises(SpecError, match="empty device edits"):
        write_specs([bad], tmp_path, "yaml")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_dir_leaves_existing_spec_untouched(tmp_path):
    out = tmp_path / "cdi"
    out.mkdir()
    existing = out / "nvidia.com-gpu.yaml"
    existing.write_text("old\n")
    os.chmod(out, 0o500)
    try:
        if os.access(out, os.W_OK):  # root ignores mode bits: make the directory immutable instead
            os.chmod(out, 0o755)
            os.system(f"chattr +i {out} 2>/dev/null")
        with pytest.raises(DevinjectError, match=str(out)):
            write_specs([_specs("hgx-h100")["nvidia.com/gpu"]], out, "yaml")
    finally:
        os.system(f"chattr -i {out} 2>/dev/null")
        os.chmod(out, 0o755)
    assert existing.read_text() == "old\n"
    assert [p.name for p in out.iterdir()] == ["nvidia.com-gpu.yaml"]


def test_json_format_round_trips():
    spec = _specs("mi300x")["amd.com/gpu"]
    import json

    data = json.loads(render(spec, "json"))
    assert data["kind"] == "amd.com/gpu" and data["cdiVersion"] == "0.5.0"
    assert data["containerEdits"]["deviceNodes"][0]["path"] == "/dev/kfd"


def test_device_with_no_nodes_is_not_emitted(host_copy):
    root = host_copy("mi300x")
    import shutil

    shutil.rmtree(root / "sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0"
                  "/0000:04:00.0/0000:05:00.0/drm")
    spec = {s.kind: s for s in generate_specs(GenerateOptions(root=str(root), hook_path=HOOK))}["amd.com/gpu"]
    assert spec.device("0") is None and spec.device("1") is not None


def test_target_root_writes_host_paths_as_the_hosts_runtime_sees_them():
    """A node agent in a pod reads the host at /host; the spec is for the host's runtime, which sees /."""
    root = HOSTS / "hgx-h100"
    specs = generate_specs(GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", target_root="/"))
    seen = 0
    for spec in specs:
        for edits in [spec.edits, *(d.edits for d in spec.devices)]:
            for path in [n.host_path or n.path for n in edits.device_nodes] + [m.host_path for m in edits.mounts]:
                assert not path.startswith(str(root)), path
                assert os.path.lexists(str(root) + path), path  # the same file, seen from the host's /
                seen += 1
    assert seen > 20
    moved = generate_specs(GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", target_root="/host"))
    gpu = next(s for s in moved if s.kind == "nvidia.com/gpu")
    assert gpu.devices[0].edits.device_nodes[0].host_path == "/host/dev/nvidia2"


def test_driver_root_takes_driver_files_from_there_and_nodes_from_the_host(host_copy):
    """GPU-operator style: the driver's files live in a container's root on the host (/run/nvidia/driver);
    device nodes stay the host's. Container paths are the driver root's own."""
    import shutil

    plain = {s.kind: s for s in generate_specs(GenerateOptions(root=str(HOSTS / "hgx-h100"), hook_path=HOOK))}
    root = host_copy("hgx-h100")
    driver = root / "run/nvidia/driver"
    for moved in ("usr/lib/x86_64-linux-gnu", "usr/bin", "lib/firmware", "etc"):
        (driver / moved).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(root / moved), str(driver / moved))
    (root / "etc").mkdir()
    shutil.copy(driver / "etc/os-release", root / "etc/os-release")
    without = generate_specs(GenerateOptions(root=str(root), hook_path=HOOK, kinds=("nvidia.com/gpu",)))
    assert not without[0].edits.mounts  # nothing of the driver on the host itself
    for target, prefix in ((None, f"{root}/run/nvidia/driver"), ("/", "/run/nvidia/driver")):
        gpu = {s.kind: s for s in generate_specs(GenerateOptions(root=str(root), hook_path=HOOK, target_root=target,
                                                                 driver_root="/run/nvidia/driver"))}["nvidia.com/gpu"]
        expected = plain["nvidia.com/gpu"].edits
        assert [m.container_path for m in gpu.edits.mounts] == [m.container_path for m in expected.mounts]
        assert gpu.edits.mounts and all(m.host_path.startswith(prefix + "/") for m in gpu.edits.mounts)
        assert [m.host_path.removeprefix(prefix) for m in gpu.edits.mounts] == \
               [m.host_path.removeprefix(str(HOSTS / "hgx-h100")) for m in expected.mounts]
        nodes = [n.host_path or n.path for n in gpu.devices[0].edits.device_nodes]
        assert nodes == ([f"{root}/dev/nvidia2"] if target is None else ["/dev/nvidia2"])  # from the host
        assert gpu.edits.hooks == expected.hooks  # container paths: the same links and folders
    with pytest.raises(ConfigError, match="--driver-root"):
        generate_specs(GenerateOptions(root=str(root), hook_path=HOOK, driver_root="/run/absent"))


def test_a_spec_names_one_hook_per_need_and_none_when_nothing_is_needed():
    """links, devices' own links and the linker cache: one process; only links: create-symlinks; only the
    cache: update-ldcache; nothing: no hook. Never a device-level hook: a container of two GPUs would start
    one process per GPU."""
    every = [spec for host in sorted(HOSTS.iterdir()) for spec in _specs(host.name).values()]
    assert every and all(len(spec.edits.hooks) <= 1 and not any(d.edits.hooks for d in spec.devices) for spec in every)
    by_command = {kind: [h.args[2] for h in spec.edits.hooks] for kind, spec in _specs("gaudi2").items()}
    assert by_command["habana.ai/gaudi"] == ["update-ldcache"]  # libraries, no links to make
    assert [h.args[2] for h in _specs("hgx-h100")["nvidia.com/rdma"].edits.hooks] == []  # nothing to make
    (intel,) = _specs("workstation")["intel.com/gpu"].edits.hooks  # no libraries: its DRM by-path links only
    assert intel.args[2:] == ("create-symlinks", "--device-link", "../card0::/dev/dri/by-path/pci-0000:00:02.0-card",
                              "--device-link", "../renderD128::/dev/dri/by-path/pci-0000:00:02.0-render")
    spec = _specs("mi300x")["amd.com/gpu"]
    (amd,) = spec.edits.hooks
    assert amd.args[2] == "links-and-ldcache"
    device_links = [v for flag, v in itertools.pairwise(amd.args) if flag == "--device-link"]
    whole = [d for d in spec.devices if d.name.isdigit()]  # GPU 7 is offered as its 8 partitions: no by-path links
    drm_nodes = [n.path for d in whole for n in d.edits.device_nodes if n.path.startswith("/dev/dri/")]
    assert len(whole) == 7 and len(device_links) == len(drm_nodes) == 14  # each GPU's card and render node, one hook
    assert "../card1::/dev/dri/by-path/pci-0000:05:00.0-card" in device_links


def test_a_library_directory_without_libraries_asks_for_no_linker_cache(tmp_path):
    host = tmp_path / "host"
    shutil.copytree(HOSTS / "ascend-910b", host, symlinks=True)
    folders = lambda: [a for h in _root_specs(host)["huawei.com/npu"].edits.hooks for a in h.args  # noqa: E731
                       if a.startswith("/usr/local/Ascend")]
    assert "/usr/local/Ascend/driver/lib64/common" in folders()
    (host / "usr/local/Ascend/driver/lib64/common/libc_sec.so").unlink()
    assert "/usr/local/Ascend/driver/lib64/common" not in folders()
    assert "/usr/local/Ascend/driver/lib64/driver" in folders()


def _root_specs(root):
    return {s.kind: s for s in generate_specs(GenerateOptions(root=str(root), hook_path=HOOK))}


def test_the_default_hook_and_this_installation_s_console_script_run_lean(tmp_path):
    """As install-hook writes the OCI hook: this interpreter on the hook launcher with -IS (no `site`), by
    default and for a --hook-path that is this installation's own console script; any other path as given."""
    from devinject.specs.generate import hook_command

    launcher = str(Path(generate_specs.__code__.co_filename).parent.parent / "hook" / "launcher.py")
    assert hook_command(None)[:2] == (sys.executable, (sys.executable, "-IS", launcher))
    ours = tmp_path / "devinject"
    ours.write_text(f"#!{sys.executable}\nimport sys\nfrom devinject.entry import main\nsys.exit(main())\n")
    assert hook_command(str(ours)) == hook_command(None)
    assert hook_command(str(ours), target_root="/host")[:2] == (str(ours), ("devinject",))  # another host's path
    other = tmp_path / "other"
    other.write_text("#!/usr/bin/python3\nimport sys\nfrom devinject.entry import main\nsys.exit(main())\n")
    assert hook_command(str(other))[:2] == (str(other), ("devinject",))
    launcher_path = "/opt/devinject/hook/bin/devinject"
    assert hook_command(launcher_path)[:2] == (launcher_path, ("devinject",))
    # the node hook's launcher with --node-hook: what it runs, named directly (no /bin/sh), in its environment
    from devinject.install.nodehook import bundle_command

    bundled = bundle_command("/opt/devinject/hook")
    assert hook_command(launcher_path, target_root="/", node_hook=bundled) == bundled
    assert bundled[2] == ("PYTHONHOME=/opt/devinject/hook", f"PYTHONPATH=/opt/devinject/hook/lib/python"
                          f"{sys.version_info[0]}.{sys.version_info[1]}/site-packages")
    spec = {s.kind: s for s in generate_specs(GenerateOptions(root=str(HOSTS / "hgx-h100")))}["nvidia.com/gpu"]
    (hook,) = spec.edits.hooks
    assert (hook.path, hook.args[:5]) == (sys.executable, (sys.executable, "-IS", launcher, "cdi-hook",
                                                           "links-and-ldcache"))


def test_the_merged_hook_does_not_raise_the_cdi_version():
    merged = _specs("hgx-h100")["nvidia.com/gpu"].edits.hooks
    assert [h.args[2] for h in merged] == ["links-and-ldcache"]
    spec = Spec("a.com/b", (Device("gpu-a", ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="c", major=1,
                                                                                    minor=2),))),),
                edits=ContainerEdits(hooks=merged))
    assert required_version(spec) == "0.3.0"
