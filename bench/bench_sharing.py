#!/usr/bin/env python3
"""Benchmark GPU sharing on the HGX H100 fixture (8 GPUs), in this process, no sockets:

- pods per GPU served: the device plugin's time-sliced offer (replicas 1, 4, 8), a pod at a time asking for
  one replica through GetPreferredAllocation and Allocate's rules, until none is left; the most pods any GPU
  got before every GPU had one (the spread), and the pods served;
- the device plugin's answer per pod, exclusive (one device per GPU) against 4 replicas per GPU: preferred
  allocation + Allocate's answer, p50;
- DRA prepare (claim spec written and fsynced, booked, checkpointed) of one GPU: exclusive, TimeSlicing (its
  interval set through the fixture's stand-in nvidia-smi: two calls), MPS (a stand-in control program as the
  daemon: its start is in the time), and a consumable-capacity share (20Gi of a GPU published with 80Gi and 4
  shares, three other shares of it held: the ledger sums them), p50 and p99, each against the exclusive
  baseline measured in the same run.

Prints figures; asserts nothing."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devinject.agent.mps import MpsDaemons  # noqa: E402
from devinject.deviceplugin.allocation import PluginDevice, answer, preferred  # noqa: E402
from devinject.deviceplugin.sharing import check_replicas, preferred_replicas, replicated  # noqa: E402
from devinject.discovery.topology import Place  # noqa: E402
from devinject.dra.capacity import CapacitySharing  # noqa: E402
from devinject.dra.driver import DraDriver, DraOptions  # noqa: E402
from devinject.specs.generate import GenerateOptions, generate_specs  # noqa: E402

HGX = REPO / "tests/fixtures/hosts/hgx-h100"
BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
STAND_IN = """#!/bin/sh
if [ "$1" = "-f" ]; then
    : > "$CUDA_MPS_PIPE_DIRECTORY/control"
    while [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/quit" ]; do sleep 0.01; done
    exit 0
fi
read -r command
[ "$command" = quit ] && : > "$CUDA_MPS_PIPE_DIRECTORY/quit"
"""


class Api:
    def __init__(self) -> None:
        self.claims: dict[str, dict[str, Any]] = {}

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        return {}

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self.claims[name]


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def gpus() -> dict[str, PluginDevice]:
    out = {}
    for index, bus in enumerate(BUSES):
        address = f"0000:{bus}:00.0"
        out[address] = PluginDevice(address, f"nvidia.com/gpu={index}", True,
                                    Place(address, (address,), 0 if index < 4 else 1, ""))
    return out


def pods_per_gpu() -> None:
    print("pods per GPU served (one replica per pod, until none is left):")
    for replicas in (1, 4, 8):
        devices = replicated(gpus(), replicas) if replicas > 1 else gpus()
        free = sorted(devices)
        per_gpu: dict[str, int] = {}
        worst_before_spread = 0
        while free:
            pick = (preferred_replicas if replicas > 1 else preferred)(devices, free, [], 1)
            check_replicas(devices, pick, fail_greater_than_one=True)
            free.remove(pick[0])
            gpu = devices[pick[0]].parent or pick[0]
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
            if len(per_gpu) < len(BUSES):
                worst_before_spread = max(worst_before_spread, per_gpu[gpu])
        print(f"  replicas {replicas}: {sum(per_gpu.values())} pods on {len(per_gpu)} GPUs, "
              f"{max(per_gpu.values())} per GPU at most, {worst_before_spread} on any GPU before each had one")


def plugin_answer(runs: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-sharing-"))
    try:
        specs = {s.kind: s for s in generate_specs(GenerateOptions(root=str(HGX), hook_path="/usr/bin/devinject",
                                                                   kinds=("nvidia.com/gpu",)))}
        spec = specs["nvidia.com/gpu"]
        print(f"device plugin, preferred allocation + Allocate's answer for one pod ({runs} runs):")
        medians = {}
        kinds = {"exclusive": (gpus(), preferred), "4 replicas": (replicated(gpus(), 4), preferred_replicas)}
        samples: dict[str, list[float]] = {label: [] for label in kinds}
        for _ in range(runs):  # in turn, as below
            for label, (devices, choose) in kinds.items():
                start = time.perf_counter()
                pick = choose(devices, sorted(devices), [], 1)
                check_replicas(devices, pick, fail_greater_than_one=False)
                answer("nvidia.com/gpu", spec, devices, pick)
                samples[label].append((time.perf_counter() - start) * 1000)
        for label, taken in samples.items():
            medians[label] = statistics.median(taken)
            print(f"  {label}: p50 {medians[label]:.3f} ms, p99 {percentile(taken, 99):.3f} ms")
        print(f"  ratio 4 replicas / exclusive: {medians['4 replicas'] / medians['exclusive']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def dra_prepare(runs: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-sharing-dra-"))
    try:
        api = Api()
        dirs = {name: str(work / name) for name in ("plugins", "registry", "cdi", "state", "driver")}
        os.makedirs(dirs["state"], mode=0o755)
        control = Path(dirs["driver"], "usr/bin/nvidia-cuda-mps-control")
        control.parent.mkdir(parents=True)
        control.write_text(STAND_IN)
        control.chmod(0o755)
        opts = DraOptions(generate=GenerateOptions(root=str(HGX), hook_path="/usr/bin/devinject"),
                          node_name="node1", plugin_dir=dirs["plugins"], registry_dir=dirs["registry"],
                          cdi_dir=dirs["cdi"], state_dir=dirs["state"], rescan=3600)
        driver = DraDriver(opts, api)
        driver.preparer.mps = MpsDaemons(dirs["state"], driver_root=dirs["driver"])
        driver.refresh()
        shares = {name: str(work / "shares" / name) for name in ("plugins", "registry", "cdi", "state")}
        os.makedirs(shares["state"], mode=0o755)
        shared = DraDriver(DraOptions(generate=opts.generate, node_name="node1", plugin_dir=shares["plugins"],
                                      registry_dir=shares["registry"], cdi_dir=shares["cdi"], state_dir=shares["state"],
                                      rescan=3600, capacity=CapacitySharing(4, 80 * 2**30)), api)
        shared.refresh()
        for _ in range(3):  # three shares held: the fourth's booking sums theirs
            book_share(api, shared, str(uuid.uuid4()))
        configs: dict[str, list[dict[str, Any]]] = {
            "exclusive": [],
            "TimeSlicing": [{"opaque": {"driver": "dra.devinject.io", "parameters": {
                "apiVersion": "dra.devinject.io/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing"}}}}],
            "MPS": [{"opaque": {"driver": "dra.devinject.io", "parameters": {
                "apiVersion": "dra.devinject.io/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}}}],
        }
        print(f"DRA prepare of one GPU ({runs} new claims each, the strategies in turn so that the machine's "
              "noise falls on all; MPS: the daemon's start included, its stop not):")
        samples: dict[str, list[float]] = {label: [] for label in [*configs, "capacity share"]}
        for round_ in range(runs + 5):
            uid = str(uuid.uuid4())
            start = time.perf_counter()
            book_share(api, shared, uid)
            if round_ >= 5:
                samples["capacity share"].append((time.perf_counter() - start) * 1000)
            shared.preparer.unprepare(uid)
            for label, config in configs.items():
                uid = str(uuid.uuid4())
                api.claims[uid] = {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {
                    "results": [{"request": "gpu", "driver": "dra.devinject.io", "pool": "node1-nvidia-com-gpu",
                                 "device": "gpu-0000-18-00-0"}], "config": config}}}}
                start = time.perf_counter()
                driver.preparer.prepare("default", uid, uid)
                if round_ >= 5:  # the first rounds warm up
                    samples[label].append((time.perf_counter() - start) * 1000)
                driver.preparer.unprepare(uid)
        base = statistics.median(samples["exclusive"])
        for label, taken in samples.items():
            median = statistics.median(taken)
            print(f"  {label}: p50 {median:.2f} ms, p99 {percentile(taken, 99):.2f} ms, "
                  f"ratio to exclusive {median / base:.2f}")
        driver.servers.stop()
        shared.servers.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def book_share(api: Api, driver: DraDriver, uid: str) -> None:
    """A claim the scheduler gave a 20Gi share of GPU 0, prepared."""
    api.claims[uid] = {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": "dra.devinject.io", "pool": "node1-nvidia-com-gpu", "device": "gpu-0000-18-00-0",
         "shareID": str(uuid.uuid4()), "consumedCapacity": {"memory": "20Gi", "shares": "1"}}], "config": []}}}}
    driver.preparer.prepare("default", uid, uid)


def main() -> int:
    runs = int(os.environ.get("BENCH_RUNS", "100"))
    pods_per_gpu()
    plugin_answer(runs * 5)
    dra_prepare(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
