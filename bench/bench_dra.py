#!/usr/bin/env python3
"""Benchmark `devinject dra-driver`: NodePrepareResources over the real unix socket (a kubelet-side gRPC client
here, the driver in this process) on the HGX H100 fixture for claims of 1 and 8 devices, p50 and p99; each
claim is new (a spec written, fsynced, booked in the ledger, checkpointed) and unprepared after, untimed. Then
the ResourceSlices of the 1,024-device synthetic host (bench_generate.py's: 8 ConnectX PFs x 127 VFs) built
from discovery, and the driver's RSS. Prints figures; asserts nothing."""

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
sys.path.insert(0, str(REPO / "bench"))
import grpc  # noqa: E402
from bench_generate import synthetic_host  # noqa: E402

from devinject.discovery.node import Node  # noqa: E402
from devinject.dra.api import dra_v1_pb2 as dra  # noqa: E402
from devinject.dra.api import dra_v1_pb2_grpc as dra_grpc  # noqa: E402
from devinject.dra.driver import DraDriver, DraOptions  # noqa: E402
from devinject.dra.slices import DRIVER, offers, resource_slices  # noqa: E402
from devinject.specs.generate import GenerateOptions  # noqa: E402

HGX = REPO / "tests/fixtures/hosts/hgx-h100"
GPUS = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]


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


def rss_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-dra-"))
    api = Api()
    dirs = {name: str(work / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    opts = DraOptions(generate=GenerateOptions(root=str(HGX), hook_path="/usr/bin/devinject"), node_name="node1",
                      plugin_dir=dirs["plugins"], registry_dir=dirs["registry"], cdi_dir=dirs["cdi"],
                      state_dir=dirs["state"], rescan=3600)
    driver = DraDriver(opts, api)
    driver.start()
    driver.refresh()
    channel = grpc.insecure_channel(f"unix://{driver.servers.endpoint}")
    grpc.channel_ready_future(channel).result(timeout=5)
    stub = dra_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]
    runs = int(os.environ.get("BENCH_RUNS", "200"))
    print(f"NodePrepareResources over {driver.servers.endpoint} (hgx-h100, {runs} new claims each):")
    for count in (1, 8):
        samples = []
        for _ in range(runs):
            uid = str(uuid.uuid4())
            api.claims[uid] = {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {"results": [
                {"request": "gpus", "driver": DRIVER, "pool": "node1-nvidia-com-gpu", "device": f"gpu-0000-{bus}-00-0"}
                for bus in GPUS[:count]]}}}}
            claim = dra.Claim(namespace="default", name=uid, uid=uid)
            start = time.perf_counter()
            answer = stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[claim]), timeout=10)
            samples.append((time.perf_counter() - start) * 1000)
            assert answer.claims[uid].error == "", answer.claims[uid].error
            stub.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[claim]), timeout=10)
        print(f"  {count} device{'s' if count > 1 else ' '}: p50 {statistics.median(samples):6.2f} ms   "
              f"p99 {percentile(samples, 99):6.2f} ms   max {max(samples):6.2f} ms")
    print(f"  driver RSS after: {rss_mib():.0f} MiB (this process: the driver, its gRPC servers and the client)")
    channel.close()
    driver.servers.stop()

    big = work / "synthetic-1024"
    devices = synthetic_host(big, 127)
    start = time.perf_counter()
    node = Node(str(big), check=False)
    built = resource_slices(DRIVER, "node1", offers(node, "node1"))
    elapsed = (time.perf_counter() - start) * 1000
    print(f"ResourceSlices of the {devices}-device synthetic host: {len(built)} slices, "
          f"{sum(len(s['spec'].get('devices', [])) for s in built)} devices, built from discovery in {elapsed:.0f} ms")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
