"""NVML's facts on the paths a user reads them from: `list` (MEMORY and CC columns, `--json`), through the
stub libnvidia-ml built from the fixture host's data (tests/nvmlstub)."""

from __future__ import annotations

import json

from tests.unit.test_cli import run

H100_MIB = 81559


def columns(table: str, *names: str) -> list[tuple[str, ...]]:
    """The cells under `names` in each row of `list`'s table (columns start where their header does)."""
    header, *rows = table.splitlines()
    starts = [(" " + header).index(f" {name} ") for name in names]
    return [tuple(row[at:].strip().split("  ")[0] for at in starts) for row in rows]


def test_list_shows_memory_and_compute_capability(nvml_host, tmp_path):
    root = nvml_host("hgx-h100")
    state = str(tmp_path / "state")
    done = run("list", "--root", str(root), "--nvml", "--state-dir", state, "--kind", "nvidia.com/gpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:5] == ["DEVICE", "PCI", "MODEL", "MEMORY", "CC"]
    assert set(columns(done.stdout, "MEMORY", "CC")) == {(f"{H100_MIB}MiB", "9.0")}
    rows = json.loads(run("list", "--root", str(root), "--nvml", "--json", "--state-dir", state).stdout)
    gpus = [r for r in rows if r["kind"] == "nvidia.com/gpu"]
    assert len(gpus) == 8
    assert {(r["memory_bytes"], r["compute_capability"]) for r in gpus} == {(H100_MIB * 1024 * 1024, "9.0")}
    assert all(r["memory_bytes"] is None and r["compute_capability"] is None for r in rows if r not in gpus)


def test_list_without_nvml_leaves_them_out(nvml_host, tmp_path):
    root = nvml_host("hgx-h100")
    rows = json.loads(run("list", "--root", str(root), "--json", "--state-dir", str(tmp_path / "s")).stdout)
    assert {(r["memory_bytes"], r["compute_capability"]) for r in rows} == {(None, None)}  # off off the host's /
    done = run("list", "--root", str(root), "--no-nvml", "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 0 and set(columns(done.stdout, "MEMORY", "CC")) == {("-", "-")}


def test_list_names_each_mig_devices_profile_and_memory(nvml_host, tmp_path):
    root = nvml_host("dgx-a100-mig")
    done = run("list", "--root", str(root), "--nvml", "--state-dir", str(tmp_path / "s"), "--kind", "nvidia.com/gpu")
    assert done.returncode == 0, done.stderr
    assert columns(done.stdout, "DEVICE", "MODEL", "MEMORY", "CC") == [
        ("nvidia.com/gpu=0", "NVIDIA A100-SXM4-80GB", "81920MiB", "8.0"),
        ("nvidia.com/gpu=0:0", "MIG 3g.40gb gi1-ci0", "40192MiB", "-"),
        ("nvidia.com/gpu=0:1", "MIG 3g.40gb gi2-ci0", "40192MiB", "-"),
        ("nvidia.com/gpu=1", "NVIDIA A100-SXM4-80GB", "81920MiB", "8.0")]


def test_a_failing_nvml_is_one_warning_and_the_sysfs_table(nvml_host, tmp_path):
    root = nvml_host("hgx-h100", omit=("nvmlInitWithFlags",))
    done = run("list", "--root", str(root), "--nvml", "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 0
    warnings = [line for line in done.stderr.splitlines() if "NVML" in line]
    assert len(warnings) == 1 and "sysfs only" in warnings[0], done.stderr
    assert set(columns(done.stdout, "MEMORY", "CC")) == {("-", "-")}


def _slices(root, sharing=None):  # type: ignore[no-untyped-def]
    from devinject.discovery.node import Node
    from devinject.dra.slices import DRIVER, offers, resource_slices, shareable

    offered = shareable(offers(Node(str(root), check=False, nvml=True), "node1"), sharing)
    return {d["name"]: d for s in resource_slices(DRIVER, "node1", offered) for d in s["spec"].get("devices", [])}


def test_dra_gpus_carry_nvidias_attributes_and_memory(nvml_host):
    """The names, types and values NVIDIA's gpu-kubelet-plugin publishes for the same GPU through the same
    NVML (../shared/peers/README.md: cudaComputeCapability 9.0.0, cudaDriverVersion 12.4.0, memory 81559Mi)."""
    gpu = _slices(nvml_host("hgx-h100"))["gpu-0000-18-00-0"]
    attributes = gpu["attributes"]
    assert {name: attributes[name] for name in ("productName", "brand", "architecture", "cudaComputeCapability",
                                                "cudaDriverVersion", "driverVersion")} == {
        "productName": {"string": "NVIDIA H100 80GB HBM3"}, "brand": {"string": "Nvidia"},
        "architecture": {"string": "Hopper"}, "cudaComputeCapability": {"version": "9.0.0"},
        "cudaDriverVersion": {"version": "12.4.0"}, "driverVersion": {"version": "550.54.14"}}
    assert gpu["capacity"] == {"memory": {"value": f"{H100_MIB}Mi"}}  # as the API server stores it


def test_dra_mig_devices_carry_their_profile_and_memory(nvml_host):
    devices = _slices(nvml_host("dgx-a100-mig"))
    mig = devices["gpu-0000-07-00-0-gi1-ci0"]
    assert mig["attributes"]["profile"] == {"string": "3g.40gb"}
    assert mig["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert mig["capacity"] == {"memory": {"value": "40192Mi"}}
    assert "profile" not in devices["gpu-0000-07-00-0"]["attributes"]  # the whole GPU has no profile


def test_dra_without_nvml_publishes_what_sysfs_gives(host_copy):
    gpu = _slices(host_copy("hgx-h100"))["gpu-0000-18-00-0"]  # the fixture's libnvidia-ml answers nothing
    assert "capacity" not in gpu and "cudaComputeCapability" not in gpu["attributes"]


def test_consumable_capacity_memory_auto_is_nvmls(nvml_host):
    from devinject.dra.capacity import parse_capacity_sharing

    gpu = _slices(nvml_host("hgx-h100"), parse_capacity_sharing("shares=2,memory=auto"))["gpu-0000-18-00-0"]
    assert gpu["allowMultipleAllocations"] is True
    assert gpu["capacity"]["memory"]["value"] == f"{H100_MIB}Mi"


def test_the_agents_node_asks_nvml_as_its_options_say(nvml_host, tmp_path):
    """`watch`, `device-plugin` and `dra-driver` (--nvml, --driver-root) make their node in watched_node."""
    from devinject.agent.watch import WatchOptions, watched_node
    from devinject.specs.generate import GenerateOptions

    root = nvml_host("hgx-h100")
    node = watched_node(WatchOptions(generate=GenerateOptions(root=str(root), nvml=True), state_dir=str(tmp_path)))
    assert len(node.nvml_facts().gpus) == 8
    node = watched_node(WatchOptions(generate=GenerateOptions(root=str(root)), state_dir=str(tmp_path)))
    assert node.nvml_facts().gpus == ()


def test_doctor_says_what_nvml_says_of_the_gpu(nvml_host, tmp_path):
    root = nvml_host("dgx-a100-mig")
    args = ("doctor", "--root", str(root), "--state-dir", str(tmp_path / "s"), "--json", "nvidia.com/gpu=0")
    (found,) = json.loads(run(*args, "--nvml").stdout)
    pci = found["checks"][0]
    assert pci["link"] == "pci" and pci["ok"] is True
    assert pci["detail"].endswith("; NVML: Ampere, compute capability 8.0, 81920MiB, MIG on, "
                                  "MIG devices 3g.40gb, 3g.40gb"), pci["detail"]
    (without,) = json.loads(run(*args).stdout)
    assert "NVML" not in without["checks"][0]["detail"]
