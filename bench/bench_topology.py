#!/usr/bin/env python3
"""Benchmark topology: `devinject topo` (matrix and JSON), GPU-NIC pairing, `generate --bundles gpu-nic`
and placement on a synthetic 1,024-device host (16 switches of 64 devices on two NUMA nodes, one GPU in
eight), against the same on a 64-device host of the same shape measured in the same run (the baseline), so
the growth can be read as a ratio. Prints figures; asserts nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.bench_generate import compile_bytecode, median_ms  # noqa: E402
from tests.fixtures.pcie_hosts import build_from_description, synthetic_description  # noqa: E402

from devinject.discovery.discover import discover  # noqa: E402
from devinject.discovery.host import Host  # noqa: E402
from devinject.discovery.profiles import load_profiles  # noqa: E402
from devinject.discovery.topology import place_devices, topology  # noqa: E402

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def cli(*args: str) -> None:
    subprocess.run([DEVINJECT, *args], check=True, stdout=subprocess.DEVNULL)


def figures(root: Path, runs: int) -> dict[str, float]:
    host = Host(str(root))
    found = discover(host, load_profiles(host))
    topo = topology(host, found)
    gpus = [p for p, label in zip(topo.places, topo.labels, strict=True) if label.startswith("GPU")]
    every = list(topo.places)
    last_gpu = gpus[-1].address
    return {
        "devices": len(found),
        "topo (text, fresh process)": median_ms(lambda: cli("topo", "--root", str(root)), runs),
        "topo --json (fresh process)": median_ms(lambda: cli("topo", "--root", str(root), "--json"), runs),
        "generate --bundles gpu-nic (fresh)": median_ms(
            lambda: cli("generate", "--root", str(root), "--output", "-", "--kind", "nvidia.com/gpu", "--kind",
                        "nvidia.com/rdma", "--bundles", "gpu-nic", "--hook-path", "/usr/bin/devinject"), runs),
        "pairing (in process)": median_ms(topo.pairs, runs),
        "place 8 of the GPUs": median_ms(lambda: place_devices(gpus, 8), runs * 4),
        "place 4 of all, one included": median_ms(lambda: place_devices(every, 4, (last_gpu,)), runs * 4),
    }


def main() -> int:
    compile_bytecode()
    runs = 7
    # tmpfs: the big tree is ~50,000 small files, which a disk-backed /tmp builds 15x slower
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-topo-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        build_from_description(synthetic_description(64), work / "small")
        build_from_description(synthetic_description(1024), work / "big")
        small, big = figures(work / "small", runs), figures(work / "big", runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"topology, medians: {small['devices']:.0f}-device host (baseline) vs {big['devices']:.0f}-device host")
    for name in small:
        if name == "devices":
            continue
        print(f"  {name:36} {small[name]:9.2f} ms  {big[name]:9.2f} ms   x{big[name] / small[name]:6.1f}")
    print(f"  (devices x{big['devices'] / small['devices']:.0f}; the matrix itself grows with the square)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
