#!/usr/bin/env python3
"""Benchmark the hook's spec loading with 15,000 spec files in a spec dir: each file's trust is checked on
every container start; the parse is cached (cold = YAML parsed, warm = from the spec cache).

Each figure is a fresh interpreter resolving one device, as the hook does on a container start (median of
several runs). Baseline measured in the same run: the same with a spec dir holding one file.
Prints figures; asserts nothing.
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

FILES = 15_000
RUNS = 5
CODE = """
import sys, time
start = time.perf_counter()
from devinject.hook.registry import Registry
Registry((sys.argv[1],), cache_file=sys.argv[2]).resolve(("vendor0.example/dev=0",))
print((time.perf_counter() - start) * 1000)
"""


def spec_text(index: int) -> str:
    return (f"cdiVersion: 0.5.0\nkind: vendor{index}.example/dev\ndevices:\n- name: '0'\n  containerEdits:\n"
            f"    deviceNodes:\n    - {{path: /dev/dev{index}, type: c, major: 1, minor: 3}}\n"
            "containerEdits:\n  mounts:\n  - {hostPath: /usr/lib/libvendor.so.1, containerPath: "
            "/usr/lib/libvendor.so.1, options: [ro, nosuid, nodev, bind]}\n")


def make_dir(root: Path, count: int) -> Path:
    directory = root / f"cdi-{count}"
    directory.mkdir()
    for index in range(count):
        (directory / f"vendor{index}.example-dev.yaml").write_text(spec_text(index))
    return directory


def resolve_ms(directory: Path, cache: Path) -> float:
    done = subprocess.run([sys.executable, "-c", CODE, str(directory), str(cache)], capture_output=True, text=True,
                          check=True)
    return float(done.stdout)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-specs-"))
    try:
        one, many = make_dir(root, 1), make_dir(root, FILES)
        rows = []
        for label, directory in (("1 file (baseline)", one), (f"{FILES:,} files", many)):
            cold, warm = [], []
            for run in range(RUNS):
                cache = root / f"cache-{label[:2]}-{run}.json"
                started = time.perf_counter()
                cold.append(resolve_ms(directory, cache))
                if run == 0:
                    cold_wall = (time.perf_counter() - started) * 1000
                warm.append(resolve_ms(directory, cache))
            rows.append((label, statistics.median(cold), statistics.median(warm), cold_wall))
        print(f"hook spec loading, median of {RUNS} fresh processes (ms, in-process: import + index + resolve)")
        print(f"{'spec dir':<22}{'cold (YAML)':>14}{'warm (cache)':>14}")
        for label, cold_ms, warm_ms, _ in rows:
            print(f"{label:<22}{cold_ms:>14.1f}{warm_ms:>14.1f}")
        base, big = rows
        print(f"warm: {big[2] - base[2]:.1f} ms added by {FILES:,} files ({big[2] / base[2]:.1f}x baseline); "
              f"cold: {big[1] / 1000:.2f} s; hook timeout 30 s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
