import json
import os

import pytest

from devinject.cdi.model import ContainerEdits, DeviceNode, Hook, Mount
from devinject.core.errors import HookError, ResolveError
from devinject.hook.plan import AllowDevice, Symlink, plan
from devinject.hook.registry import Registry

SPEC = """---
cdiVersion: 0.5.0
kind: vendor.com/gpu
devices:
- name: '0'
  containerEdits:
    deviceNodes: [{path: /dev/gpu0, type: c, major: 195, minor: 0}]
- name: '1'
  containerEdits:
    deviceNodes: [{path: /dev/gpu1, type: c, major: 195, minor: 1, permissions: rw}]
containerEdits:
  deviceNodes: [{path: /dev/gpuctl, type: c, major: 195, minor: 255}]
  mounts:
  - {hostPath: /host/lib/libgpu.so.1.2, containerPath: /usr/lib/libgpu.so.1.2, options: [ro, nosuid, nodev, bind]}
  - {hostPath: /host/lib, containerPath: /usr, options: [ro, bind]}
  hooks:
  - hookName: createContainer
    path: /usr/bin/devinject
    args: [devinject, cdi-hook, create-symlinks, --link, libgpu.so.1.2::/usr/lib/libgpu.so.1]
  - hookName: createContainer
    path: /usr/bin/devinject
    args: [devinject, cdi-hook, update-ldcache, --folder, /usr/lib]
  - {hookName: createContainer, path: /opt/other/hook}
"""


@pytest.fixture
def registry(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "etc" / "vendor.yaml").write_text(SPEC)
    return Registry((str(tmp_path / "etc"), str(tmp_path / "run")), cache_file=str(tmp_path / "cache.json"))


def test_resolution_adds_spec_edits_once_then_device_edits(registry):
    resolved = registry.resolve(("vendor.com/gpu=0", "vendor.com/gpu=1"))
    assert [n.path for n in resolved.edits.device_nodes] == ["/dev/gpuctl", "/dev/gpu0", "/dev/gpu1"]
    assert [name for name, _ in resolved.devices] == ["vendor.com/gpu=0", "vendor.com/gpu=1"]


def test_unknown_device_lists_what_the_kind_offers(registry):
    with pytest.raises(ResolveError, match="vendor.com/gpu=7: vendor.com/gpu offers 0, 1"):
        registry.resolve(("vendor.com/gpu=0", "vendor.com/gpu=7"))
    with pytest.raises(ResolveError, match="no spec for kind other.com/x"):
        registry.resolve(("other.com/x=0",))


def test_later_spec_dir_wins(registry, tmp_path):
    (tmp_path / "run" / "vendor.yaml").write_text(SPEC.replace("minor: 0}", "minor: 9}"))
    registry._devices = None
    resolved = registry.resolve(("vendor.com/gpu=0",))
    assert resolved.devices[0][1].device_nodes[0].minor == 9


def test_two_files_of_one_kind_both_offer_devices_and_same_dir_duplicates_conflict(registry, tmp_path):
    (tmp_path / "etc" / "extra.yaml").write_text(SPEC.replace("name: '0'", "name: extra").replace(
        "name: '1'", "name: '2'"))
    assert registry.resolve(("vendor.com/gpu=extra", "vendor.com/gpu=0")).names
    (tmp_path / "etc" / "dup.yaml").write_text(SPEC)
    fresh = Registry(registry.spec_dirs)
    with pytest.raises(ResolveError, match=r"vendor.com/gpu=0: defined in both .*vendor.yaml"):
        fresh.resolve(("vendor.com/gpu=0",))
    assert fresh.resolve(("vendor.com/gpu=extra",)).names  # the rest of the kind is unaffected


def test_spec_cache_is_used_and_invalidated(registry, tmp_path):
    registry.resolve(("vendor.com/gpu=0",))
    assert (tmp_path / "cache.json").exists()
    spec = tmp_path / "etc" / "vendor.yaml"
    spec.write_text(SPEC.replace("minor: 0}", "minor: 5}"))
    os.utime(spec, ns=(1, 1))
    fresh = Registry(registry.spec_dirs, cache_file=str(tmp_path / "cache.json"))
    assert fresh.resolve(("vendor.com/gpu=0",)).devices[0][1].device_nodes[0].minor == 5


def test_broken_spec_blocks_only_its_own_kind_and_is_named(registry, tmp_path):
    (tmp_path / "run" / "broken.yaml").write_text("cdiVersion: 0.5.0\nkind: a.com/b\ndevices: [{name: x}]\n")
    registry._devices = None
    assert registry.resolve(("vendor.com/gpu=0",)).names == ("vendor.com/gpu=0",)  # other kinds still work
    with pytest.raises(ResolveError, match=r"broken\.yaml: devices\[0\]\.containerEdits: empty device edits"):
        registry.resolve(("a.com/b=x",))


def test_plan_orders_parents_before_children_and_parses_devinject_hooks(registry):
    steps = plan(registry.resolve(("vendor.com/gpu=1",)).edits)
    assert [m.container_path for m in steps.mounts] == ["/usr", "/usr/lib/libgpu.so.1.2"]
    assert steps.mounts[0].readonly and not steps.mounts[0].nosuid
    assert steps.mounts[1].readonly and steps.mounts[1].nosuid and steps.mounts[1].nodev
    assert steps.links == (Symlink("libgpu.so.1.2", "/usr/lib/libgpu.so.1"),)
    assert steps.ldcache_folders == ("/usr/lib",)
    assert AllowDevice("c", 195, 1, "rw") in steps.allow and AllowDevice("c", 195, 255, "rwm") in steps.allow
    assert any("/opt/other/hook" in w for w in steps.warnings)


def test_missing_numbers_are_filled_from_the_host_node():
    st = os.stat("/dev/null")
    steps = plan(ContainerEdits(device_nodes=(DeviceNode("/dev/null"),)))
    assert (steps.nodes[0].type, steps.nodes[0].major, steps.nodes[0].minor) == ("c", 1, 3)
    assert steps.nodes[0].mode == st.st_mode & 0o7777


def test_unfillable_node_is_an_error():
    with pytest.raises(HookError, match="/dev/nope"):
        plan(ContainerEdits(device_nodes=(DeviceNode("/dev/nope", host_path="/nonexistent/dev/nope"),)))


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        (ContainerEdits(mounts=(Mount("/a", "/b", ("ro", "exotic")),)), "option 'exotic'"),
        (ContainerEdits(mounts=(Mount("/a", "/b", (), "tmpfs"),)), "type 'tmpfs'"),
        (ContainerEdits(mounts=(Mount("/a", "relative"),)), "absolute"),
        (ContainerEdits(hooks=(Hook("createContainer", "/usr/bin/devinject",
                                    ("devinject", "cdi-hook", "create-symlinks", "--link", "nolink")),)), "TARGET::"),
        (ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="c", major=1, minor=2, permissions="rx"),)),
         "only r, w, m"),
    ],
)
def test_plan_rejects_what_it_cannot_do_safely(edits, message):
    with pytest.raises(HookError, match=message):
        plan(edits)


def test_forward_compat_argument_and_version_order():
    from devinject.hook.plan import ForwardCompat, newer_than, parse_cdi_hook, parse_forward_compat

    command, values = parse_cdi_hook(["update-ldcache", "--folder", "/usr/lib",
                                      "--forward-compat=/c:libcuda.so:550.54.14"])
    assert command == "update-ldcache" and values["--folder"] == ["/usr/lib"]
    assert parse_forward_compat(values["--forward-compat"][0]) == ForwardCompat("/c", "libcuda.so", "550.54.14")
    assert newer_than("560.35.03", "550.54.14") and newer_than("550.54.15", "550.54.14")
    assert not newer_than("550.54.14", "550.54.14") and not newer_than("545.99.99", "550.54.14")
    assert not newer_than("560.x", "550.54.14") and not newer_than("", "550.54.14")
    assert newer_than("1000.1", "999.99.99")  # numeric, not string order
    for bad in ("relative:libcuda.so:1.0", "/c:a/b:1.0", "/c:libcuda.so:abc", "/c"):
        with pytest.raises(HookError, match="--forward-compat"):
            parse_forward_compat(bad)
    with pytest.raises(HookError, match="unexpected argument"):
        parse_cdi_hook(["create-symlinks", "--folder", "/x"])


def test_the_hook_runs_a_merged_cdi_hook_and_the_launcher_form_inline():
    """A spec's `links-and-ldcache` hook, named as generate names it by default (this interpreter on the hook
    launcher), is one of devinject's own: the OCI hook makes its links and linker cache itself."""
    import sys

    from devinject.hook.plan import LAUNCHER_SUFFIX, ForwardCompat

    launcher = f"/usr/lib/python3/dist-packages{LAUNCHER_SUFFIX}"
    hook = Hook("createContainer", sys.executable, (sys.executable, "-IS", launcher, "cdi-hook", "links-and-ldcache",
                                                    "--link", "libx.so.1.0::/usr/lib/libx.so.1", "--folder", "/usr/lib",
                                                    "--forward-compat", "/compat:libx.so:1.0"))
    steps = plan(ContainerEdits(hooks=(hook,)))
    assert steps.links == (Symlink("libx.so.1.0", "/usr/lib/libx.so.1"),)
    assert steps.ldcache_folders == ("/usr/lib",)
    assert steps.forward_compat == (ForwardCompat("/compat", "libx.so", "1.0"),)
    assert steps.warnings == ()
    other = hook._replace(args=(sys.executable, "-IS", "/opt/other/launcher.py", "cdi-hook", "create-symlinks"))
    assert "skipped" in plan(ContainerEdits(hooks=(other,))).warnings[0]
    # the node hook's loader and interpreter, as `generate --node-hook` names them: inline too
    from devinject.install.nodehook import bundle_command

    program, argv, env = bundle_command("/opt/devinject/hook")
    bundled = Hook("createContainer", program, (*argv, *hook.args[3:]), env)
    assert plan(ContainerEdits(hooks=(bundled,))) == steps
    for wrong in (("-c", "import os", "cdi-hook"), ("-x", argv[-1], "cdi-hook"), ("-c", argv[-1], "other")):
        foreign = bundled._replace(args=(*argv[:-2], *wrong, *hook.args[4:]))
        assert "skipped" in plan(ContainerEdits(hooks=(foreign,))).warnings[0]


def test_a_merged_cdi_hook_takes_both_commands_flags_and_the_single_ones_keep_theirs():
    from devinject.hook.plan import parse_cdi_hook

    command, values = parse_cdi_hook(["links-and-ldcache", "--link", "a::/l", "--folder=/usr/lib",
                                      "--forward-compat", "/c:libx.so:1.0"])
    assert command == "links-and-ldcache"
    assert values == {"--link": ["a::/l"], "--device-link": [], "--folder": ["/usr/lib"],
                      "--forward-compat": ["/c:libx.so:1.0"], "--application-profile": []}
    for single, foreign in (("create-symlinks", "--folder"), ("update-ldcache", "--link")):
        with pytest.raises(HookError, match="unexpected argument"):
            parse_cdi_hook([single, foreign, "/x"])


def test_a_cdi_hook_takes_the_launchers_server_flags_and_nothing_else_new():
    """`--server SOCKET` / `--no-server` choose the hook server (hook/client.py); the hook itself ignores them."""
    from devinject.hook.plan import parse_cdi_hook

    for extra in (["--server", "/run/x.sock"], ["--server=/run/x.sock"], ["--no-server"]):
        command, values = parse_cdi_hook(["links-and-ldcache", "--link", "a::/l", *extra, "--folder", "/usr/lib"])
        assert values["--link"] == ["a::/l"] and values["--folder"] == ["/usr/lib"], extra
    for bad in (["--server"], ["--servers", "/x"], ["--no-server=1"]):
        with pytest.raises(HookError, match="unexpected argument"):
            parse_cdi_hook(["create-symlinks", *bad])


BY_PATH = ("--device-link", "../card1::/dev/dri/by-path/pci-0000:01:00.0-card",
           "--device-link", "../renderD129::/dev/dri/by-path/pci-0000:01:00.0-render",
           "--device-link", "../card2::/dev/dri/by-path/pci-0000:02:00.0-card")


def test_the_oci_hook_makes_the_device_links_of_the_devices_it_gives_only():
    """The spec-level hook names every GPU's by-path links; a container given card1 gets card1's links, never
    one naming another GPU's PCI address (nor a dangling link to a node it lacks)."""
    hook = Hook("createContainer", "/usr/bin/devinject", ("devinject", "cdi-hook", "create-symlinks", *BY_PATH))
    given = (DeviceNode("/dev/dri/card1", type="c", major=226, minor=1),
             DeviceNode("/dev/dri/renderD129", type="c", major=226, minor=129))
    steps = plan(ContainerEdits(device_nodes=given, hooks=(hook,)))
    assert steps.links == (Symlink("../card1", "/dev/dri/by-path/pci-0000:01:00.0-card"),
                           Symlink("../renderD129", "/dev/dri/by-path/pci-0000:01:00.0-render"))
    assert plan(ContainerEdits(hooks=(hook,))).links == ()
    bad = hook._replace(args=("devinject", "cdi-hook", "create-symlinks", "--device-link", "../card1"))
    with pytest.raises(HookError, match="--device-link '../card1' is not TARGET::/ABSOLUTE/LINK"):
        plan(ContainerEdits(device_nodes=given, hooks=(bad,)))


def _cdi_hook_container(tmp_path, devices):
    """A container as a runtime hands it to a createContainer hook: its bundle's config.json listing
    `devices` (char nodes: paths, or their minors by path), the OCI state on a pipe."""
    rootfs = tmp_path / "bundle" / "rootfs"
    (rootfs / "dev" / "dri").mkdir(parents=True)
    minors = devices if isinstance(devices, dict) else dict.fromkeys(devices, 1)
    config = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
              "linux": {"devices": [{"path": p, "type": "c", "major": 226, "minor": m} for p, m in minors.items()]}}
    (rootfs.parent / "config.json").write_text(json.dumps(config))
    read, write = os.pipe()
    os.write(write, json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                                "bundle": str(rootfs.parent)}).encode())
    os.close(write)
    return rootfs, read


def test_a_cdi_hook_makes_the_device_links_of_the_container_s_own_devices(tmp_path):
    from devinject.hook.cdihook import run_cdi_hook

    rootfs, stdin = _cdi_hook_container(tmp_path, ["/dev/dri/card2", "/dev/nvidia0"])
    try:
        run_cdi_hook(["create-symlinks", *BY_PATH], stdin)
    finally:
        os.close(stdin)
    assert sorted(os.listdir(rootfs / "dev/dri/by-path")) == ["pci-0000:02:00.0-card"]
    assert os.readlink(rootfs / "dev/dri/by-path/pci-0000:02:00.0-card") == "../card2"


def test_a_cdi_hook_whose_devices_are_not_in_the_container_makes_nothing(tmp_path):
    from devinject.hook.cdihook import run_cdi_hook

    rootfs, stdin = _cdi_hook_container(tmp_path, ["/dev/nvidia0"])
    try:
        assert run_cdi_hook(["create-symlinks", *BY_PATH], stdin) == []
    finally:
        os.close(stdin)
    assert os.listdir(rootfs / "dev/dri") == []  # not even the by-path directory
