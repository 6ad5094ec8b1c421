#!/usr/bin/env python3
"""Benchmark `devinject generate`: the HGX H100 fixture end to end, and synthetic hosts of 128..1024 devices
(8 ConnectX PFs x N SR-IOV VFs) to show the cost is linear in devices. Prints figures; asserts nothing.

Baseline measured in the same run: the interpreter starting and exiting (`python -c pass`), so the
end-to-end figure can be read as "devinject's own work".
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.fixtures.build_hosts import FakeHost, connectx  # noqa: E402

from devinject.specs.generate import GenerateOptions, generate_specs, render  # noqa: E402

DEVINJECT = str(Path(sys.executable).parent / "devinject")
HGX = REPO / "tests/fixtures/hosts/hgx-h100"


def median_ms(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def synthetic_host(root: Path, vfs_per_pf: int) -> int:
    """8 ConnectX-7 PFs, each with `vfs_per_pf` VFs, every function with its own uverbs/umad nodes."""
    host = FakeHost(root)
    index = 0
    for pf in range(8):
        hb = f"0000:{0x10 * pf:02x}"
        host.bridge([hb, f"{hb}:01.0"])
        bus = 0x10 * pf + 1
        pf_path = connectx(host, [hb, f"{hb}:01.0", f"0000:{bus:02x}:00.0"], index, numa=pf // 4)
        index += 1
        for vf in range(vfs_per_pf):
            dev, fn = divmod(vf + 1, 8)
            bdf = f"0000:{bus:02x}:{dev:02x}.{fn}"
            path = connectx(host, [hb, f"{hb}:01.0", bdf], index, device=0x101E, numa=pf // 4)
            host.relink(f"{path}/physfn", pf_path)
            index += 1
    host.finish(ldconfig=False)
    return index


def compile_bytecode() -> None:
    """As an install does: with PYTHONDONTWRITEBYTECODE set, every run would otherwise recompile edited modules."""
    import compileall

    import devinject

    compileall.compile_dir(os.path.dirname(devinject.__file__), quiet=1)


def main() -> int:
    compile_bytecode()
    runs = 15
    baseline = median_ms(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), runs)
    e2e = median_ms(lambda: subprocess.run([DEVINJECT, "generate", "--root", str(HGX), "--output", "-",
                                            "--hook-path", "/usr/bin/devinject"], check=True,
                                           stdout=subprocess.DEVNULL), runs)

    def library_run(root: Path) -> None:
        for spec in generate_specs(GenerateOptions(root=str(root), hook_path="/usr/bin/devinject")):
            render(spec, "yaml")

    in_process = median_ms(lambda: library_run(HGX), runs)
    print(f"interpreter start+exit (baseline)      {baseline:8.1f} ms")
    print(f"HGX H100 (16 devices) end to end       {e2e:8.1f} ms   target <= 250 ms   "
          f"x{e2e / baseline:.1f} of baseline")
    print(f"HGX H100 in process (discover+render)  {in_process:8.1f} ms")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-"))
    try:
        for vfs in (15, 31, 63, 127):
            root = work / f"vf{vfs}"
            devices = synthetic_host(root, vfs)
            ms = median_ms(lambda root=root: library_run(root), 5)
            rows.append((devices, ms))
            print(f"synthetic {devices:5d} devices              {ms:8.1f} ms   {ms / devices * 1000:7.1f} us/device"
                  + ("   target <= 2000 ms" if devices == 1024 else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (small_n, small_ms), (big_n, big_ms) = rows[0], rows[-1]
    print(f"linearity: {big_n / small_n:.1f}x devices -> {big_ms / small_ms:.1f}x time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
