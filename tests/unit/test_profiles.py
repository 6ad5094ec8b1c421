import re
from pathlib import Path

import pytest

from devinject.core.errors import ConfigError
from devinject.discovery.host import Host
from devinject.discovery.profiles import builtin_profiles, load_profiles, parse_profile
from devinject.specs.generate import GenerateOptions, generate_specs

ADMIN_PROFILE = """
name: acme-npu
kind: acme.example/npu
match: {vendor: ["1da3"], class: ["1200"]}
priority: 5
device-nodes:
  - class: accel
    names: ["accel[0-9]*"]
env: ["ACME_RUNTIME=1"]
"""


def test_builtin_profiles_cover_every_shipped_family():
    kinds = {p.kind for p in builtin_profiles()}
    assert kinds >= {"nvidia.com/gpu", "amd.com/gpu", "intel.com/gpu", "habana.ai/gaudi", "nvidia.com/rdma",
                     "huawei.com/npu", "xilinx.com/fpga", "devinject.io/vfio"}


def test_admin_adds_a_family_as_data_without_code(host_copy):
    root = host_copy("gaudi2")
    (root / "etc/devinject/profiles.d").mkdir(parents=True)
    (root / "etc/devinject/profiles.d/acme.yaml").write_text(ADMIN_PROFILE)
    specs = generate_specs(GenerateOptions(root=str(root), kinds=("acme.example/npu",), hook_path="/x"))
    (spec,) = specs
    assert spec.edits.env == ("ACME_RUNTIME=1",)
    assert [n.path for n in spec.device("3").edits.device_nodes] == ["/dev/accel/accel3"]


def test_admin_profile_with_same_name_replaces_the_shipped_one(host_copy):
    root = host_copy("gaudi2")
    (root / "etc/devinject/profiles.d").mkdir(parents=True)
    (root / "etc/devinject/profiles.d/gaudi.yaml").write_text(
        "name: habana-gaudi\nkind: habana.ai/gaudi\nmatch: {vendor: ['1da3']}\nsharing: shared\n"
        "device-nodes: [{class: accel, names: ['accel[0-9]*']}]\n")
    profile = next(p for p in load_profiles(Host(str(root))) if p.name == "habana-gaudi")
    assert profile.sharing == "shared" and profile.source.endswith("gaudi.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nkind: bad\n", "x.yaml.kind: kind 'bad': expected vendor/class"),
        ("name: x\nkind: a.com/b\nbogus: 1\n", "x.yaml.bogus: unknown field"),
        ("name: x\nkind: a.com/b\nmatch: {vendor: [zz]}\n", "x.yaml.match.vendor: 'zz' is not a hex id"),
        ("name: x\nkind: a.com/b\ndevice-nodes: [{class: drm, sysfs: /x}]\n",
         "x.yaml.device-nodes[0]: give exactly one"),
        ("name: x\nkind: a.com/b\nenv: [NOEQUALS]\n", "x.yaml.env: 'NOEQUALS' is not KEY=VALUE"),
        ("name: x\nkind: a.com/b\nsharing: sometimes\n", "x.yaml.sharing: expected one of exclusive, shared"),
        ("name: x\nkind: a.com/b\ngroup-by: bus\n", "x.yaml.group-by: expected function or slot"),
        ("name: x\nkind: a.com/b\nmodels: [a]\n", "x.yaml.models: expected a mapping of device id to name"),
        ("name: x\nkind: a.com/b\nmodels: {zz: A}\n", "x.yaml.models: keys must be hex device ids"),
        ("name: x\nkind: a.com/b\ndevice-nodes: {a: 1}\n", "x.yaml: device-nodes and shared-nodes are lists"),
        # the first problem in the order the fields are read: group-by before models before env
        ("name: x\nkind: a.com/b\nenv: [NOEQUALS]\nmodels: {zz: A}\ngroup-by: bus\n", "x.yaml.group-by"),
        ("name: x\nkind: a.com/b\nenv: [NOEQUALS]\nmodels: {zz: A}\n", "x.yaml.models"),
    ],
    ids=["kind", "unknown-field", "vendor-hex", "two-sources", "env", "sharing", "group-by", "models-mapping",
         "models-hex", "node-lists", "first-of-three", "first-of-two"],
)
def test_bad_profiles_name_file_and_field(text, message):
    import yaml

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_profile(yaml.safe_load(text), "x.yaml")


def test_unparseable_admin_profile_is_a_config_error(host_copy):
    root = host_copy("empty-vm")
    (root / "etc/devinject/profiles.d").mkdir(parents=True)
    (root / "etc/devinject/profiles.d/broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+:\d+: expected "):  # FILE:LINE:COL, as --config
        load_profiles(Host(str(root)))


def test_a_refused_profile_gets_pyyamls_fuller_message_at_the_same_place(host_copy):
    """libyaml reads the profiles (5x faster); what it refuses is read again for PyYAML's message, which names
    the alias libyaml's leaves out."""
    root = host_copy("empty-vm")
    (root / "etc/devinject/profiles.d").mkdir(parents=True)
    (root / "etc/devinject/profiles.d/alias.yaml").write_text("name: &x a\nkind: *y\n")
    with pytest.raises(ConfigError, match=r"alias\.yaml:2:7: found undefined alias 'y'$"):
        load_profiles(Host(str(root)))


def test_the_shipped_profiles_are_read_by_libyaml_and_read_the_same_by_pyyaml(monkeypatch):
    import yaml

    from devinject.discovery import profiles as profiles_module

    shipped = Path(profiles_module.__file__).parent.parent / "data/profiles"
    texts = sorted(shipped.glob("*.yaml"))
    assert texts
    for path in texts:
        text = path.read_text()
        assert yaml.load(text, Loader=yaml.CSafeLoader) == yaml.load(text, Loader=yaml.SafeLoader), path.name

    def slow(*_: object, **__: object) -> object:
        raise AssertionError("PyYAML's pure loader read a shipped profile")

    monkeypatch.setattr(yaml, "safe_load", slow)
    assert builtin_profiles()


def test_mount_options_per_file_from_the_profile(tmp_path, host_copy):
    """Some stacks need a writable mount: `mount-options` gives one container path its own options, and the
    hook's plan honours them; every other driver file stays ro, nosuid, nodev."""
    from devinject.cdi.model import ContainerEdits
    from devinject.hook.plan import plan
    from devinject.specs.generate import GenerateOptions, generate_specs
    root = host_copy("hgx-h100")
    (root / "run/nvidia-persistenced").mkdir(parents=True)
    (root / "run/nvidia-persistenced/socket").write_text("")  # the daemon's socket, as a file here
    shipped = Path(__file__).resolve().parents[2] / "src/devinject/data/profiles/nvidia-gpu.yaml"
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "nvidia-gpu.yaml").write_text(shipped.read_text() + (
        'mount-options:\n  "/run/nvidia-persistenced/*": [rw, nosuid, nodev, bind]\n'))
    opts = GenerateOptions(root=str(root), kinds=("nvidia.com/gpu",), profile_dirs=(str(profiles),),
                           hook_path="/usr/bin/devinject", nvml=False)
    (spec,) = generate_specs(opts)
    by_path = {m.container_path: m.options for m in spec.edits.mounts}
    assert by_path["/run/nvidia-persistenced/socket"] == ("rw", "nosuid", "nodev", "bind")
    assert by_path["/usr/bin/nvidia-smi"] == ("ro", "nosuid", "nodev", "bind")
    steps = plan(ContainerEdits(mounts=spec.edits.mounts))
    writable = [m for m in steps.mounts if not m.readonly]
    assert [m.container_path for m in writable] == ["/run/nvidia-persistenced/socket"]


@pytest.mark.parametrize(("options", "message"), [
    ('{"/run/x": [rw, bind, sticky]}', "unknown option 'sticky'"),
    ('{"/run/x": [rw]}', "add bind or rbind"),
    ('{"run/x": [rw, bind]}', "not an absolute path"),
])
def test_bad_mount_options_name_the_field(options, message):
    from devinject.core.errors import ConfigError
    from devinject.discovery.profiles import _load_yaml, parse_profile

    with pytest.raises(ConfigError, match=message):
        parse_profile(_load_yaml(f"name: x\nkind: a.com/b\nmount-options: {options}\n", "x.yaml"), "x.yaml")
