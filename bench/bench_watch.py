#!/usr/bin/env python3
"""Benchmark `devinject watch` on the HGX H100 fixture (16 devices): CPU use when idle with the default
timings, and the time from an injected fault to the spec rewritten with timings tuned for tests.
Baseline measured in the same run: the CPU cost of one one-shot `devinject health` round. Prints figures.
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
DEVINJECT = str(Path(sys.executable).parent / "devinject")
GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def watch(root: Path, work: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([DEVINJECT, "watch", "--root", str(root), "--output-dir", str(work / "cdi"),
                             "--state-dir", str(work / "state"), "--hook-path", DEVINJECT, *extra],
                            stderr=subprocess.DEVNULL)


def names(spec: Path) -> str:
    try:
        return spec.read_text()
    except OSError:
        return ""


def main() -> int:
    idle_seconds = float(os.environ.get("BENCH_IDLE_SECONDS", "40"))
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-watch-"))
    try:
        root = work / "host"
        shutil.copytree(REPO / "tests/fixtures/hosts/hgx-h100", root, symlinks=True)
        rounds = 5
        for _ in range(rounds):
            subprocess.run([DEVINJECT, "health", "--root", str(root)], stdout=subprocess.DEVNULL)
        children = os.times()
        health_cpu = (children.children_user + children.children_system) / rounds

        agent = watch(root, work / "idle")
        time.sleep(3)  # start-up (first scan and write) is not idle time
        before, t0 = cpu_seconds(agent.pid), time.monotonic()
        time.sleep(idle_seconds)
        used, elapsed = cpu_seconds(agent.pid) - before, time.monotonic() - t0
        agent.terminate()
        agent.wait(10)
        print(f"one-shot health round, CPU (baseline)     {health_cpu * 1000:7.1f} ms")
        share = used / elapsed * 100
        print(f"watch idle, 16 devices, default timings   {share:7.3f} % of one core over {elapsed:.0f} s"
              "   (target <= 1 %)")

        tuned = ("--test-timings", "--interval", "1", "--recheck", "0.25", "--threshold", "3", "--rescan", "5")
        agent = watch(root, work / "fault", *tuned)
        spec = work / "fault" / "cdi" / "nvidia.com-gpu.yaml"
        deadline = time.monotonic() + 20
        while "name: '0'" not in names(spec) and time.monotonic() < deadline:
            time.sleep(0.05)
        latencies = []
        enable = root / GPU / "enable"
        for _ in range(3):
            enable.write_text("0\n")
            injected = time.monotonic()
            while "name: '0'" in names(spec) and time.monotonic() - injected < 30:
                time.sleep(0.01)
            latencies.append(time.monotonic() - injected)
            enable.write_text("1\n")
            restored = time.monotonic()
            while "name: '0'" not in names(spec) and time.monotonic() - restored < 30:
                time.sleep(0.01)
        agent.terminate()
        agent.wait(10)
        print(f"fault -> spec rewritten (interval 1 s, recheck 0.25 s, threshold 3)  median "
              f"{statistics.median(latencies):.2f} s  max {max(latencies):.2f} s   (target <= 3 s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
