#!/usr/bin/env python3
"""Benchmark: fault -> taint in the DRA driver's ResourceSlice, with the shipped timings (interval 10 s,
recheck 1.5 s, threshold 3), the sibling of bench_health_latency.py (the device plugin's list).

`devinject dra-driver`'s loop (`DraDriver.run`: its own health loop on a thread, as on a DRA-only node) runs
on a copy of the HGX H100 fixture; its publisher is an in-process recorder of the slices it would send to the
API server (the API server's own write adds a few ms: docs/dra.md). A fault counts as in the slice when the
latest slices give GPU 0000:18:00.0 a taint. Faults, each N times (BENCH_RUNS, default 5), put back between
runs (put-back request, or the driver bound again):

1. an Xid 79 line appended to the kernel log the loop reads, as syslog writes it;
2. a driver unbind: the function's `driver` link removed, and its `unbind` uevent handed to the loop's
   listener entry point (what the netlink thread does with it; bench_health_latency.py sends it over netlink);
3. an AER fatal counter increment (a polled signal: one interval plus the rechecks of --threshold).

Baseline, in the same run: the same unbind without its uevent (found by the poll alone).
Prints figures; asserts nothing.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from devinject.agent import healthstate  # noqa: E402
from devinject.agent.watch import WatchOptions  # noqa: E402
from devinject.dra.driver import DraDriver, DraOptions  # noqa: E402
from devinject.specs.generate import GenerateOptions  # noqa: E402

ADDRESS = "0000:18:00.0"
KEY = f"nvidia.com/gpu={ADDRESS}"
DEVICE = "gpu-0000-18-00-0"
GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
TIMEOUT = 60.0


class Recorder:
    """The API server as the driver sees it: the slices last published, and when."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.slices: list[dict[str, Any]] = []

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        with self.changed:
            self.slices = desired
            self.changed.notify_all()
        return {}

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        raise KeyError(name)

    def tainted(self) -> bool | None:
        for s in self.slices:
            for device in s["spec"].get("devices", []):
                if device["name"] == DEVICE:
                    return bool(device.get("taints"))
        return None  # not in the slices (yet)

    def wait_for(self, check: Callable[[], bool]) -> bool:
        with self.changed:
            return self.changed.wait_for(check, timeout=TIMEOUT)


class Node:
    def __init__(self, work: Path) -> None:
        self.root = work / "host"
        shutil.copytree(REPO / "tests/fixtures/hosts/hgx-h100", self.root, symlinks=True)
        self.log = self.root / "var/log/kern.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("Jan  1 00:00:00 node kernel: [    0.000000] Linux version 6.1.0\n")
        self.aer = self.root / GPU / "aer_dev_fatal"
        self.driver_link = self.root / GPU / "driver"
        self.driver_target = os.readlink(self.driver_link)
        self.state_dir = str(work / "state")
        gen = GenerateOptions(root=str(self.root), hook_path="/usr/bin/devinject",
                              kinds=("nvidia.com/gpu", "nvidia.com/rdma"))
        watch = WatchOptions(generate=gen, uevents=False)  # uevents handed to the listener entry point
        self.api = Recorder()
        self.driver = DraDriver(DraOptions(generate=gen, node_name="node1", plugin_dir=str(work / "plugins"),
                                           registry_dir=str(work / "registry"), cdi_dir=str(work / "cdi"),
                                           state_dir=self.state_dir, rescan=60.0, health="check", watch=watch),
                                self.api)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.driver.run, args=(self.stop,), daemon=True)
        self.thread.start()
        if not self.api.wait_for(lambda: self.api.tainted() is False):
            raise SystemExit("the driver never published the GPU untainted")
        deadline = time.monotonic() + TIMEOUT
        while self.driver.loop is None or self.driver.loop.checker.log_position()[1] is None:
            if time.monotonic() > deadline:
                raise SystemExit("the health loop never read the kernel log")
            time.sleep(0.05)

    def uevent(self, action: str) -> None:
        assert self.driver.loop is not None
        self.driver.loop.uevent({"ACTION": action, "SUBSYSTEM": "pci", "PCI_SLOT_NAME": ADDRESS,
                                 "DEVPATH": "/" + GPU.removeprefix("sys/")})

    def tainted_after(self, inject: Callable[[], None]) -> float:
        started = time.monotonic()
        inject()
        if not self.api.wait_for(lambda: bool(self.api.tainted())):
            raise SystemExit("the fault never reached the slice")
        return time.monotonic() - started

    def back(self, repair: Callable[[], None]) -> None:
        repair()
        if not self.api.wait_for(lambda: self.api.tainted() is False):
            raise SystemExit("the GPU's taint never went")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)


def main() -> int:
    runs = int(os.environ.get("BENCH_RUNS", "5"))
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-dra-health-"))
    node = Node(work)
    aer_total = 0

    def put_back() -> None:
        healthstate.request_put_back(str(node.root), node.state_dir, KEY)

    def xid() -> None:
        with open(node.log, "a") as handle:
            handle.write("Jan  1 00:00:01 node kernel: [ 4242.123456] NVRM: Xid (PCI:0000:18:00): 79, pid=0, "
                         "name=python3, GPU has fallen off the bus.\n")

    def unbind(announce: bool) -> Callable[[], None]:
        def inject() -> None:
            node.driver_link.unlink()
            if announce:
                node.uevent("unbind")
        return inject

    def rebind() -> None:
        node.driver_link.symlink_to(node.driver_target)
        node.uevent("bind")

    def aer_fatal() -> None:
        nonlocal aer_total
        aer_total += 1
        node.aer.write_text(f"ERR_FATAL {aer_total}\nTOTAL_ERR_FATAL {aer_total}\n")

    cases: list[tuple[str, Callable[[], None], Callable[[], None], str]] = [
        ("Xid 79 line appended to the kernel log", xid, put_back, "<= 1 s"),
        ("driver unbind + its uevent (handed over)", unbind(True), rebind, "<= 1 s"),
        ("AER fatal counter 0 -> 1 (polled)", aer_fatal, put_back, "<= 10 + 2 x 1.5 = 13 s"),
        ("baseline: the same unbind, no uevent (poll)", unbind(False), rebind, "the interval"),
    ]
    figures: dict[str, list[float]] = {}
    try:
        for name, inject, repair, _ in cases:
            figures[name] = []
            for _ in range(runs):
                figures[name].append(node.tainted_after(inject))
                node.back(repair)
    finally:
        node.close()
        shutil.rmtree(work, ignore_errors=True)
    baseline = statistics.median(figures[cases[-1][0]])
    print(f"fault -> taint in the ResourceSlice, dra-driver's own health loop on hgx-h100, shipped timings "
          f"(interval 10 s, recheck 1.5 s, threshold 3), {runs} runs each")
    for name, _, _, target in cases:
        values = figures[name]
        p50 = statistics.median(values)
        print(f"  {name:52s} p50 {p50:6.3f} s  max {max(values):6.3f} s  "
              f"({p50 / baseline:5.3f} x baseline)   target {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
