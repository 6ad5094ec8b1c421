"""`generate --bundles gpu-nic` on hosts described as data: each GPU with its closest NIC, each NUMA node's
GPUs and NICs, the hints workloads read; goldens reviewed by hand, plus the rules asserted directly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from devinject.cdi.model import Spec
from devinject.specs.generate import GenerateOptions, generate_specs, render
from tests.conftest import FIXTURES, HOSTS, TOPOLOGY_HOSTS

GOLDEN = FIXTURES / "golden-bundles"
HOOK = "/usr/bin/devinject"
DEVINJECT = str(Path(sys.executable).parent / "devinject")



def bundle_spec(root: Path) -> Spec | None:
    specs = generate_specs(GenerateOptions(root=str(root), hook_path=HOOK, bundles=("gpu-nic",)))
    return next((s for s in specs if s.kind == "nvidia.com/gpu-nic"), None)


def summary(spec: Spec) -> dict[str, tuple[list[str], list[str]]]:
    """device -> (its device node paths, its env)"""
    return {d.name: ([n.path for n in d.edits.device_nodes], list(d.edits.env)) for d in spec.devices}


@pytest.mark.parametrize("name", TOPOLOGY_HOSTS)
def test_bundle_specs_match_reviewed_goldens(topology_hosts, name: str, update_golden: bool) -> None:  # type: ignore[no-untyped-def]
    spec = bundle_spec(topology_hosts / name)
    assert spec is not None
    text = render(spec, "yaml").replace(str(topology_hosts / name), "<ROOT>")
    golden = GOLDEN / f"{name}.yaml"
    if update_golden:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{name}: gpu-nic spec differs from golden (make golden to review)"


def test_switch_pairs_share_the_switch_nic_and_numa_sets_hold_the_socket(topology_hosts) -> None:  # type: ignore[no-untyped-def]
    spec = bundle_spec(topology_hosts / "hgx-h100-4sw")
    assert spec is not None and spec.cdi_version == "0.5.0"
    devices = summary(spec)
    assert list(devices) == [*map(str, range(8)), "numa0", "numa1"]
    assert devices["0"] == (["/dev/nvidia0", "/dev/infiniband/uverbs0", "/dev/infiniband/issm0",
                             "/dev/infiniband/umad0"], ["NCCL_IB_HCA==mlx5_0", "DEVINJECT_NUMA_NODE=0"])
    assert devices["5"][1] == ["NCCL_IB_HCA==mlx5_2", "DEVINJECT_NUMA_NODE=1"]
    numa1_nodes, numa1_env = devices["numa1"]
    assert [p for p in numa1_nodes if p.startswith("/dev/nvidia")] == [f"/dev/nvidia{i}" for i in range(4, 8)]
    assert [p for p in numa1_nodes if "uverbs" in p] == ["/dev/infiniband/uverbs2", "/dev/infiniband/uverbs3"]
    assert numa1_env == ["NCCL_IB_HCA==mlx5_2,mlx5_3", "DEVINJECT_NUMA_NODE=1"]
    shared = [n.path for n in spec.edits.device_nodes]
    assert "/dev/nvidiactl" in shared and "/dev/infiniband/rdma_cm" in shared  # both specs' common edits


def test_no_pair_across_sockets_and_no_guessed_numa(topology_hosts) -> None:  # type: ignore[no-untyped-def]
    root_ports = bundle_spec(topology_hosts / "root-ports")
    assert root_ports is not None and list(summary(root_ports)) == ["0", "1", "numa0"]  # GPU2: SYS only
    unknown = bundle_spec(topology_hosts / "numa-unknown")
    assert unknown is not None
    assert summary(unknown) == {"0": (["/dev/nvidia0", "/dev/infiniband/uverbs0", "/dev/infiniband/issm0",
                                       "/dev/infiniband/umad0"], ["NCCL_IB_HCA==mlx5_0"])}


def test_no_bundles_without_nics_or_unless_asked() -> None:
    assert bundle_spec(HOSTS / "mi300x") is None  # GPUs, no RDMA NIC
    plain = generate_specs(GenerateOptions(root=str(HOSTS / "hgx-h100"), hook_path=HOOK))
    assert all(s.kind != "nvidia.com/gpu-nic" for s in plain)


def test_any_vendors_gpus_pair_with_the_nic() -> None:
    specs = generate_specs(GenerateOptions(root=str(HOSTS / "workstation"), hook_path=HOOK, bundles=("gpu-nic",)))
    bundles = {s.kind: [d.name for d in s.devices] for s in specs if s.kind.endswith("/gpu-nic")}
    assert bundles == {"intel.com/gpu-nic": ["0"], "nvidia.com/gpu-nic": ["0"]}  # NUMA unknown: no sets


def test_written_bundle_spec_validates_and_unknown_bundle_is_an_error(topology_hosts, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out, four_switches = tmp_path / "cdi", str(topology_hosts / "hgx-h100-4sw")
    done = subprocess.run([DEVINJECT, "generate", "--root", four_switches, "--output-dir", str(out),
                           "--bundles", "gpu-nic", "--hook-path", HOOK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (out / "nvidia.com-gpu-nic.yaml").exists()
    done = subprocess.run([DEVINJECT, "validate", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([DEVINJECT, "generate", "--root", four_switches, "--output-dir", str(out),
                           "--bundles", "gpu-gpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "gpu-gpu" in done.stderr


def test_hook_books_a_bundle_node_by_node_as_the_kinds_offering_them(topology_hosts, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """gpu-nic=0 and gpu-nic=1 share switch 0's NIC (RDMA is shared) but not a GPU: both are booked. The
    GPU inside a bundle stays exclusive against the plain GPU device and against another bundle."""
    import os

    from devinject.core.errors import LedgerError
    from devinject.hook.main import HookOptions, HostParts

    out, four_switches = tmp_path / "cdi", str(topology_hosts / "hgx-h100-4sw")
    done = subprocess.run([DEVINJECT, "generate", "--root", four_switches, "--output-dir", str(out),
                           "--bundles", "gpu-nic", "--hook-path", HOOK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    opts = HookOptions()
    opts.spec_dirs, opts.state_dir = (str(out),), str(tmp_path / "state")

    def book(container: str, *names: str) -> None:
        parts = HostParts(opts)
        parts.book(container, os.getpid(), parts.resolve(names))

    book("a", "nvidia.com/gpu-nic=0")
    book("b", "nvidia.com/gpu-nic=1")  # the same NIC, another GPU
    book("c", "nvidia.com/rdma=0")  # the NIC alone, shared
    with pytest.raises(LedgerError, match="c 195:0"):
        book("d", "nvidia.com/gpu=0")  # the GPU of bundle 0
    with pytest.raises(LedgerError, match="c 195:0 is held by container a"):
        book("e", "nvidia.com/gpu-nic=numa0")  # holds GPUs 0-3


def test_list_shows_the_pairing(topology_hosts) -> None:  # type: ignore[no-untyped-def]
    import json

    done = subprocess.run([DEVINJECT, "list", "--root", str(topology_hosts / "root-ports"), "--json",
                           "--state-dir", "/nonexistent"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    paired = {row["name"]: [f"{p['name']} ({p['relation']})" for p in row["paired_with"]]
              for row in json.loads(done.stdout)}
    assert paired == {"nvidia.com/gpu=0": ["nvidia.com/rdma=0 (PHB)"], "nvidia.com/gpu=1": ["nvidia.com/rdma=0 (PHB)"],
                      "nvidia.com/gpu=2": [],
                      "nvidia.com/rdma=0": ["nvidia.com/gpu=0 (PHB)", "nvidia.com/gpu=1 (PHB)"]}
