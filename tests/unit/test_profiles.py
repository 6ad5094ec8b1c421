import re

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
        ("name: x\nkind: a.com/b\nsharing: sometimes\n", "x.yaml.sharing"),
    ],
    ids=["kind", "unknown-field", "vendor-hex", "two-sources", "env", "sharing"],
)
def test_bad_profiles_name_file_and_field(text, message):
    import yaml

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_profile(yaml.safe_load(text), "x.yaml")


def test_unparseable_admin_profile_is_a_config_error(host_copy):
    root = host_copy("empty-vm")
    (root / "etc/devinject/profiles.d").mkdir(parents=True)
    (root / "etc/devinject/profiles.d/broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: invalid YAML"):
        load_profiles(Host(str(root)))
