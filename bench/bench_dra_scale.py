#!/usr/bin/env python3
"""The DRA driver past one machine, by simulation: N Node objects with no kubelet, each with a real
`devinject dra-driver` over the HGX H100 fixture (its own state, CDI and socket dirs: no kubelet registers
it), against one real API server and scheduler (../shared/kube/cluster-up.sh). For N = 10, 25, 50:

- API requests per node per minute, idle and under churn (a GPU taken out and put back in each node's
  health.json every 10 s, so every driver republishes its GPU pool), from the API server's own
  `apiserver_request_total` (resourceslices and resourceclaims; what the control plane itself asks in a
  baseline minute with no driver is given too);
- ResourceSlice objects and bytes per node;
- the scheduler's time to allocate M = N claims of one GPU each (pods tolerating the simulated nodes'
  not-ready taints: from their creation until every claim has its allocation);
- the drivers' RSS.

Root, the cluster's scripts, ~10 min; run under the live-test lock. Prints JSON (and writes
build/dra-scale.json); asserts nothing. The cluster is taken down at the end."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.kube import KUBE, KubeClient, until  # noqa: E402

KUBE_DIR = Path("/tmp/devinject-dra-scale")
WORK = Path("/run/devinject-dra-scale")
HOST = REPO / "tests/fixtures/hosts/hgx-h100"
DEVINJECT = str(Path(sys.executable).parent / "devinject")
DRIVER = "dra.devinject.io"
POOLS_PER_NODE = 2  # gpu and rdma on the HGX fixture
GPU_NODE = "c 195:0"  # /dev/nvidia0: taken out and put back for churn
METRIC = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$')


def requests(kube: KubeClient) -> dict[str, float]:
    """apiserver_request_total of resourceslices and resourceclaims, by resource and verb."""
    out: dict[str, float] = {}
    for line in kube.kubectl("get", "--raw", "/metrics", timeout=60).splitlines():
        found = METRIC.match(line)
        if not found:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', found["labels"]))
        if labels.get("resource") in ("resourceslices", "resourceclaims"):
            key = f"{labels['resource']} {labels['verb']}"
            out[key] = out.get(key, 0) + float(found["value"])
    return out


def delta(before: dict[str, float], after: dict[str, float], nodes: int, minutes: float) -> dict[str, Any]:
    per = {k: round((after.get(k, 0) - before.get(k, 0)) / max(nodes, 1) / minutes, 2)
           for k in sorted(set(before) | set(after)) if after.get(k, 0) != before.get(k, 0)}
    return {"per_node_per_minute": round(sum(per.values()), 2), "by_verb": per}


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as handle:
                total += next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def add_nodes(kube: KubeClient, count: int) -> None:
    for i in range(count):
        name = f"sim-{i}"
        kube.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"sim": "true"}}})
        status = {"status": {"capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
                             "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"}}}
        kube.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps(status))


def start_drivers(count: int, rescan: float) -> list[subprocess.Popen[bytes]]:
    drivers = []
    for i in range(count):
        base = WORK / f"sim-{i}"
        for sub in ("state", "cdi", "plugins", "registry"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        log = open(base / "driver.log", "wb")  # noqa: SIM115 - kept open by the driver
        drivers.append(subprocess.Popen(
            [DEVINJECT, "dra-driver", "--host-root", str(HOST), "--node-name", f"sim-{i}", "--kubeconfig",
             str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(base / "state"), "--cdi-dir", str(base / "cdi"),
             "--plugin-dir", str(base / "plugins"), "--registry-dir", str(base / "registry"),
             "--hook-path", DEVINJECT, "--rescan", str(rescan),
             "--metrics-address", ""],  # N drivers on one machine: the default port is one driver's
            stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        log.close()
    return drivers


def stop_drivers(drivers: list[subprocess.Popen[bytes]]) -> None:
    for process in drivers:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in drivers:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def sim_slices(kube: KubeClient) -> list[dict[str, Any]]:
    items = kube.json("resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
    return [s for s in items if s["spec"].get("nodeName", "").startswith("sim-")]


def set_health(count: int, out: bool) -> None:
    for i in range(count):
        path = WORK / f"sim-{i}" / "state" / "health.json"
        path.write_text(json.dumps({"unhealthy_nodes": [GPU_NODE] if out else []}))


def allocate(kube: KubeClient, count: int) -> float:
    """Seconds from creating `count` one-GPU claim pods until every claim is allocated."""
    toleration = [{"operator": "Exists"}]
    manifests: list[dict[str, Any]] = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                                        "metadata": {"name": "one-gpu"}, "spec": {"spec": {"devices": {"requests": [
                                            {"name": "gpu", "exactly": {"deviceClassName": "gpu.devinject.io"}}]}}}}]
    for i in range(count):
        manifests.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"alloc-{i}"},
                          "spec": {"nodeSelector": {"sim": "true"}, "tolerations": toleration,
                                   "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                                   "containers": [{"name": "c", "image": "localhost/busybox:1",
                                                   "resources": {"claims": [{"name": "gpu"}]}}]}})
    started = time.monotonic()
    kube.apply(*manifests)

    def allocated() -> bool:
        claims = kube.json("resourceclaims")["items"]
        return sum(1 for c in claims if (c.get("status") or {}).get("allocation")) >= count

    until(allocated, 600, f"{count} claims allocated", every=0.25)
    took = time.monotonic() - started
    kube.kubectl("delete", "pods", "--all", "--grace-period=0", "--force", "--wait=true", timeout=300, check=False)
    kube.kubectl("delete", "resourceclaimtemplate", "one-gpu", "--wait=true", check=False)
    until(lambda: not kube.json("resourceclaims")["items"], 300, "claims gone")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 25, 50])
    parser.add_argument("--minute", type=float, default=60.0, help="seconds of each idle and churn window")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the cluster)")
    kube = KubeClient(KUBE_DIR, "debian")
    results: dict[str, Any] = {"host": "hgx-h100 fixture (8 GPUs, 4 NICs)", "runs": []}
    try:
        up = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=kube.env, timeout=600)
        if up.returncode != 0:
            raise SystemExit(f"cluster-up.sh failed:\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
        selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].kind == "nvidia.com/gpu"'
        kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.devinject.io"},
                    "spec": {"selectors": [{"cel": {"expression": selector}}]}})
        before = requests(kube)
        time.sleep(args.minute / 2)
        results["control_plane_alone"] = delta(before, requests(kube), 1, args.minute / 2 / 60)
        for count in args.nodes:
            shutil.rmtree(WORK, ignore_errors=True)
            add_nodes(kube, count)
            started = time.monotonic()
            drivers = start_drivers(count, rescan=5)
            try:
                until(lambda n=count: len(sim_slices(kube)) == n * POOLS_PER_NODE, 600,  # type: ignore[misc]
                      f"slices of {count} nodes")
                published = time.monotonic() - started
                time.sleep(5)
                slices = sim_slices(kube)
                run: dict[str, Any] = {
                    "nodes": count, "all_published_s": round(published, 1),
                    "slices_per_node": len(slices) / count,
                    "slice_bytes_per_node": round(sum(len(json.dumps(s)) for s in slices) / count),
                    "driver_rss_mib_each": round(rss_mib([d.pid for d in drivers]) / count, 1)}
                before = requests(kube)
                time.sleep(args.minute)
                run["idle"] = delta(before, requests(kube), count, args.minute / 60)
                before = requests(kube)
                end, out = time.monotonic() + args.minute, True
                while time.monotonic() < end:
                    set_health(count, out)
                    out = not out
                    time.sleep(10)
                set_health(count, False)
                run["churn_gpu_out_and_back_every_10s"] = delta(before, requests(kube), count, args.minute / 60)
                time.sleep(8)  # every driver back to all GPUs
                run["allocate_claims"] = count
                run["allocate_s"] = round(allocate(kube, count), 2)
                run["driver_rss_mib_each_after"] = round(rss_mib([d.pid for d in drivers]) / count, 1)
                run["drivers_alive"] = sum(1 for d in drivers if d.poll() is None)
            finally:
                stop_drivers(drivers)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
            kube.kubectl("delete", "nodes", "-l", "sim=true", "--wait=true", timeout=300, check=False)
            for item in sim_slices(kube):
                kube.kubectl("delete", "resourceslice", item["metadata"]["name"], check=False)
    finally:
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=kube.env, timeout=300)
        shutil.rmtree(WORK, ignore_errors=True)
    (REPO / "build").mkdir(exist_ok=True)
    (REPO / "build" / "dra-scale.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
