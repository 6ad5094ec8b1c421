"""GPU-NIC bundles in real containers: the four-switch HGX host (tests/fixtures/topologies/hgx-h100-4sw.yaml)
with real char nodes; `nvidia.com/gpu-nic=2` must give exactly GPU 2 and the NIC on its switch (NIC 1)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import DEVINJECT, PODMAN, Bundle, container_name, in_cdi_dir

pytestmark = pytest.mark.live

# every GPU and uverbs node the container can see, then whether the cgroup lets it reach each "driver"
SCRIPT = ("ls /dev | grep -E '^nvidia[0-9]+$'; ls /dev/infiniband | grep uverbs; echo hca=$NCCL_IB_HCA; "
          "cat /dev/nvidia2; cat /dev/infiniband/uverbs1; echo finished")


@pytest.fixture(scope="module")
def four_switch_specs(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.pcie_hosts import build_topology_host

    base = tmp_path_factory.mktemp("gpu-nic")
    build_topology_host("hgx-h100-4sw", base / "host", real_nodes=True)
    subprocess.run([DEVINJECT, "generate", "--root", str(base / "host"), "--output-dir", str(base / "cdi"),
                    "--bundles", "gpu-nic", "--hook-path", DEVINJECT], check=True, capture_output=True)
    return base / "cdi"


def visible(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("nvidia", "uverbs"))]


def test_podman_gives_the_gpu_and_its_switch_nic_with_the_nccl_hint(image: str, four_switch_specs: Path) -> None:
    with in_cdi_dir(four_switch_specs / "nvidia.com-gpu-nic.yaml"):
        done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu-nic=2", image, "sh", "-c", SCRIPT],
                              capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "finished" in out, out
    assert visible(out) == ["nvidia2", "uverbs1"], out
    assert "hca==mlx5_1" in out
    assert "can't open '/dev/nvidia2': No such device or address" in out  # reached the (absent) driver
    assert "can't open '/dev/infiniband/uverbs1': No such device or address" in out


@pytest.mark.parametrize("v2", [False, True], ids=["cgroup-v1", "cgroup-v2-ebpf"])
def test_runc_hook_gives_the_gpu_and_its_switch_nic(four_switch_specs: Path, tmp_path: Path, v2: bool) -> None:
    bundle = Bundle(tmp_path / "bundle", four_switch_specs, tmp_path / "state")
    bundle.save(["sh", "-c", SCRIPT], annotations={"cdi.k8s.io/test": "nvidia.com/gpu-nic=2"})
    done = bundle.run(container_name(), v2=v2)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert visible(out) == ["nvidia2", "uverbs1"], out
    assert "can't open '/dev/nvidia2': No such device or address" in out
    assert "can't open '/dev/infiniband/uverbs1': No such device or address" in out
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert record["result"] == "ok" and record["devices"] == ["nvidia.com/gpu-nic=2"]
    assert any("env edit(s) ignored" in w for w in record["warnings"])  # said, not silently dropped
