"""Node labels for Node Feature Discovery: the feature file follows NFD's local-source format (one
`name[=value]` per line, `#` comments, names under a namespace and values within Kubernetes' label rules), is
written atomically (a dot-file, which nfd-worker skips, renamed into place) and only when it changed, by the
`watch` loop too with taken-out devices not counted; the shipped NodeFeatureRule matches every shipped
profile's PCI vendor and classes."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import yaml
from click.testing import CliRunner

from devinject.agent.nfd import FEATURE_FILE, features, label_part, write_features
from devinject.agent.watch import Watcher
from devinject.cli import cli
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.discovery.profiles import load_profiles
from tests.conftest import HOST_NAMES, HOSTS
from tests.unit.test_watch import GPU, options

RULE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "nfd" / "nodefeaturerule.yaml"
# NFD local source: `<name>[=<value>]`; a label name is an optional DNS-subdomain prefix and a name segment
SEGMENT = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LINE = re.compile(rf"^(?P<prefix>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)/(?P<name>{SEGMENT})(=(?P<value>({SEGMENT})?))?$")


def parse(text: str) -> dict[str, str]:
    """A feature file as nfd-worker reads it, strictly: comments skipped, every other line a valid label."""
    labels = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = LINE.match(line)
        assert match, f"not a label NFD accepts: {line!r}"
        assert len(match["prefix"]) <= 253 and len(match["name"]) <= 63
        labels[f"{match['prefix']}/{match['name']}"] = match["value"] if match["value"] is not None else "true"
    return labels


def test_every_fixture_hosts_feature_file_is_valid_nfd_input():
    for name in HOST_NAMES:
        node = Node(str(HOSTS / name))
        labels = parse("\n".join(features(node.host, node.devices())))
        assert all(key.startswith("devinject.io/") for key in labels), name
        assert ("devinject.io/accelerators" in labels) == bool(node.devices()), name


def test_the_hgx_labels():
    node = Node(str(HOSTS / "hgx-h100"))
    labels = parse("\n".join(features(node.host, node.devices())))
    assert labels == {
        "devinject.io/accelerators": "true",
        "devinject.io/nvidia.com-gpu.count": "8", "devinject.io/nvidia.com-gpu.product": "NVIDIA-H100-80GB-HBM3",
        "devinject.io/nvidia.com-gpu.driver": "550.54.14",
        "devinject.io/nvidia.com-gpu.numa0": "4", "devinject.io/nvidia.com-gpu.numa1": "4",
        "devinject.io/nvidia.com-rdma.count": "8", "devinject.io/nvidia.com-rdma.product": "ConnectX-7",
        "devinject.io/nvidia.com-rdma.numa0": "4", "devinject.io/nvidia.com-rdma.numa1": "4",
    }
    mig = Node(str(HOSTS / "dgx-a100-mig"))
    assert parse("\n".join(features(mig.host, mig.devices())))["devinject.io/nvidia.com-gpu.partitions"] == "2"


def test_label_parts_are_cut_to_the_rules():
    assert label_part("AMD Instinct MI300X (CPX)") == "AMD-Instinct-MI300X-CPX"
    assert len(label_part("x" * 100)) == 63 and label_part("-a.") == "a"


def test_written_atomically_and_only_when_changed(tmp_path: Path):
    assert write_features(str(tmp_path), ["a.io/x=1"])
    assert (tmp_path / FEATURE_FILE).read_text() == "a.io/x=1\n"
    mtime = os.stat(tmp_path / FEATURE_FILE).st_mtime_ns
    assert not write_features(str(tmp_path), ["a.io/x=1"]) and os.stat(tmp_path / FEATURE_FILE).st_mtime_ns == mtime
    assert os.listdir(tmp_path) == [FEATURE_FILE]  # no temp file left, none but dot-files ever beside it


def test_the_watch_loop_writes_them_and_drops_a_taken_out_gpu(host_copy, tmp_path: Path):
    root = host_copy("hgx-h100")
    nfd = tmp_path / "features.d"
    nfd.mkdir()
    opts = replace(options(root, tmp_path), nfd_features_dir=str(nfd))
    watcher = Watcher(opts)
    watcher.rescan()
    watcher.check()
    watcher.write()
    assert parse((nfd / FEATURE_FILE).read_text())["devinject.io/nvidia.com-gpu.count"] == "8"
    (root / GPU / "enable").write_text("0\n")
    for _ in range(opts.threshold):
        watcher.check()
    watcher.write()
    assert parse((nfd / FEATURE_FILE).read_text())["devinject.io/nvidia.com-gpu.count"] == "7"


def test_labels_command_prints_and_writes(tmp_path: Path):
    done = CliRunner().invoke(cli, ["labels", "--root", str(HOSTS / "gaudi2")])
    assert done.exit_code == 0 and "devinject.io/habana.ai-gaudi.count=8" in done.output
    done = CliRunner().invoke(cli, ["labels", "--root", str(HOSTS / "gaudi2"), "--write", str(tmp_path)])
    assert done.exit_code == 0 and parse((tmp_path / FEATURE_FILE).read_text())
    done = CliRunner().invoke(cli, ["labels", "--root", str(HOSTS / "gaudi2"), "--write", str(tmp_path / "no")])
    assert done.exit_code == 2


def test_the_node_feature_rule_matches_every_shipped_profile():
    rule = yaml.safe_load(RULE.read_text())
    assert rule["apiVersion"] == "nfd.k8s-sigs.io/v1alpha1" and rule["kind"] == "NodeFeatureRule"
    (only,) = rule["spec"]["rules"]
    assert only["labels"] == {"devinject.io/accelerators": "true"}
    matched = set()
    for entry in only["matchAny"]:
        (feature,) = entry["matchFeatures"]
        assert feature["feature"] == "pci.device"
        expressions = feature["matchExpressions"]
        assert set(expressions) <= {"vendor", "class"}
        vendors = tuple(expressions["vendor"]["value"])
        classes = tuple(expressions.get("class", {}).get("value", ()))
        matched.add((vendors, classes))
    shipped = {(tuple(f"{v:04x}" for v in p.vendors), p.class_prefixes) for p in load_profiles(Host("/tmp"))
               if p.vendors}
    assert matched == shipped


def test_nvmls_labels_on_the_hgx_with_the_stub_library(nvml_host):
    node = Node(str(nvml_host("hgx-h100")), nvml=True)
    labels = parse("\n".join(features(node.host, node.devices(), gpu_facts=node.gpu_facts)))
    assert {k: v for k, v in labels.items() if k.startswith("devinject.io/nvidia.com-gpu.")} == {
        "devinject.io/nvidia.com-gpu.count": "8", "devinject.io/nvidia.com-gpu.product": "NVIDIA-H100-80GB-HBM3",
        "devinject.io/nvidia.com-gpu.driver": "550.54.14",
        "devinject.io/nvidia.com-gpu.numa0": "4", "devinject.io/nvidia.com-gpu.numa1": "4",
        "devinject.io/nvidia.com-gpu.memory": "81559",  # MiB, as GFD's nvidia.com/gpu.memory
        "devinject.io/nvidia.com-gpu.compute.major": "9", "devinject.io/nvidia.com-gpu.compute.minor": "0",
        "devinject.io/nvidia.com-gpu.family": "hopper"}
    assert not any(".memory" in k or ".family" in k for k in labels if "rdma" in k)  # NICs: no NVML facts
    # without NVML (the fixture's own library does not answer): the labels of before, none of NVML's
    plain = Node(str(HOSTS / "hgx-h100"), nvml=True)
    assert parse("\n".join(features(plain.host, plain.devices(), gpu_facts=plain.gpu_facts))) == parse(
        "\n".join(features(plain.host, plain.devices())))


def test_mig_profiles_counts_on_the_dgx_with_the_stub_library(nvml_host):
    node = Node(str(nvml_host("dgx-a100-mig")), nvml=True)
    labels = parse("\n".join(features(node.host, node.devices(), gpu_facts=node.gpu_facts)))
    assert labels["devinject.io/nvidia.com-mig-3g.40gb.count"] == "2"
    assert labels["devinject.io/nvidia.com-mig-3g.40gb.memory"] == "40192"
    assert (labels["devinject.io/nvidia.com-gpu.memory"], labels["devinject.io/nvidia.com-gpu.family"]) == (
        "81920", "ampere")
    assert (labels["devinject.io/nvidia.com-gpu.compute.major"], labels["devinject.io/nvidia.com-gpu.compute.minor"]
            ) == ("8", "0")
    # a taken-out MIG GPU's profiles are not counted, as its devices are not
    from devinject.cdi.identity import device_key

    mig_gpu = next(f for f in node.devices() if f.partitions)
    out = frozenset({device_key(mig_gpu.profile.kind, mig_gpu.address)})
    left = parse("\n".join(features(node.host, node.devices(), out=out, gpu_facts=node.gpu_facts)))
    assert not any(k.startswith("devinject.io/nvidia.com-mig-") for k in left)


def test_families_as_gpu_feature_discovery_names_them():
    from devinject.discovery.nvml import GpuFacts, architecture_family

    def family(cc: tuple[int, int] | None, arch: str | None = None) -> str | None:
        return architecture_family(GpuFacts("0000:01:00.0", compute_capability=cc, architecture=arch))

    assert [family(cc) for cc in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (6, 1))] == [
        "volta", "turing", "ampere", "ampere", "ada-lovelace", "hopper", "pascal"]
    assert family((10, 0), "Blackwell") == "blackwell" and family(None, "Hopper") == "hopper"
    assert family((10, 0), "Unknown") is None and family(None) is None


def test_the_watch_loop_writes_nvmls_labels(nvml_host, tmp_path: Path):
    root = nvml_host("dgx-a100-mig")
    nfd = tmp_path / "features.d"
    nfd.mkdir()
    opts = options(root, tmp_path)
    opts = replace(opts, nfd_features_dir=str(nfd), generate=replace(opts.generate, nvml=True))
    watcher = Watcher(opts)
    watcher.rescan()
    watcher.check()
    watcher.write()
    labels = parse((nfd / FEATURE_FILE).read_text())
    assert labels["devinject.io/nvidia.com-mig-3g.40gb.count"] == "2"
    assert labels["devinject.io/nvidia.com-gpu.family"] == "ampere"


def test_labels_command_asks_nvml(nvml_host):
    root = nvml_host("hgx-h100")
    done = CliRunner().invoke(cli, ["labels", "--root", str(root), "--nvml"])
    assert done.exit_code == 0 and "devinject.io/nvidia.com-gpu.memory=81559" in done.output
    done = CliRunner().invoke(cli, ["labels", "--root", str(root), "--no-nvml"])
    assert done.exit_code == 0 and ".memory=" not in done.output


def test_a_dra_only_node_gets_nvmls_labels_too(nvml_host, tmp_path: Path):
    """The DRA driver writes the same file from its own discovery and NVML's facts (`--nfd-features-dir`)."""
    from devinject.dra.driver import DraDriver, DraOptions
    from devinject.specs.generate import GenerateOptions
    from tests.integration.test_dra_driver import NODE, FakeApi

    features_dir = tmp_path / "features.d"
    features_dir.mkdir()
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    gen = GenerateOptions(root=str(nvml_host("dgx-a100-mig")), hook_path="/usr/bin/devinject", nvml=True)
    opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=str(tmp_path / "plugins"),
                      registry_dir=str(tmp_path / "registry"), cdi_dir=str(tmp_path / "cdi"), state_dir=str(state),
                      rescan=3600, health="follow", nfd_features_dir=str(features_dir))
    DraDriver(opts, FakeApi()).refresh()
    labels = parse((features_dir / FEATURE_FILE).read_text())
    assert labels["devinject.io/nvidia.com-mig-3g.40gb.count"] == "2"
    assert labels["devinject.io/nvidia.com-gpu.compute.major"] == "8"
