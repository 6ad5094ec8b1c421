"""Consumable capacity (DRAConsumableCapacity, beta and on in 1.36) on the real control plane: `devinject
dra-driver --consumable-capacity shares=4,memory=40Gi` over the 4-switch HGX tree, under
../shared/kube/cluster-up.sh with CONTAINERD=bundled (containerd 1.7 applies CDI), the real scheduler deducting
claims from the published capacity.

Two claims each asking 16Gi of one GPU's 40Gi (pinned to it by its PCI address) are allocated the same GPU,
each with its own shareID, and both pods run and see that GPU; the driver booked both as shares in the node's
ledger with their amounts. A third asking 16Gi of the same GPU (8Gi left) stays Pending with the scheduler's
reason; one asking 16Gi of any GPU goes to another. On the previous code the driver did not start (no such
option), and without the capacity a second claim on one GPU stayed Pending.

A missing prerequisite fails, never skips. The cluster is always taken down (`cluster-down.sh --purge`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.kube import KUBE, need, until
from tests.e2e.test_dra_live import CDI, DRIVER, HOST, KERNEL_LOG, SLEEPER, STATE, Cluster, published
from tests.fixtures.pcie_hosts import build_topology_host

pytestmark = pytest.mark.live

GPU_ADDRESS = "0000:18:00.0"
GPU = "gpu-0000-18-00-0"
PINNED = f'device.attributes["resource.kubernetes.io"].pciBusID == "{GPU_ADDRESS}"'


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    need(os.geteuid() == 0, "needs root")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh")
    shutil.rmtree(HOST.parent, ignore_errors=True)
    host = build_topology_host("hgx-h100-4sw", HOST, real_nodes=True)
    host.finish(ldconfig=False)
    (HOST / "var/log").mkdir(parents=True, exist_ok=True)
    KERNEL_LOG.write_text("kernel: Linux version 6.1.0\n")
    for directory in (HOST.parent, HOST):
        directory.chmod(0o755)
    cluster = Cluster()
    try:
        up = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=cluster.env,
                            timeout=600)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        cluster.node = cluster.json("nodes")["items"][0]["metadata"]["name"]
        cluster.log.parent.mkdir(parents=True, exist_ok=True)
        cluster.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                       "metadata": {"name": "gpu.devinject.io"},
                       "spec": {"selectors": [{"cel": {"expression":
                                f'device.driver == "{DRIVER}" && '
                                f'device.attributes["{DRIVER}"].kind == "nvidia.com/gpu"'}}]}})
        cluster.start_driver("--consumable-capacity", "shares=4,memory=40Gi", "--metrics-address", "")
        yield cluster
    finally:
        cluster.stop_driver()
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=cluster.env,
                       timeout=300)
        shutil.rmtree(HOST.parent, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def memory_pod(cluster: Cluster, name: str, memory: str, *, pinned: bool) -> None:
    """A pod whose claim asks `memory` of one GPU (of the GPU at GPU_ADDRESS when `pinned`)."""
    exactly: dict[str, Any] = {"deviceClassName": "gpu.devinject.io", "count": 1, "allocationMode": "ExactCount",
                               "capacity": {"requests": {"memory": memory}}}
    if pinned:
        exactly["selectors"] = [{"cel": {"expression": PINNED}}]
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
         "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
         "spec": {"terminationGracePeriodSeconds": 1, "resourceClaims": [
             {"name": "gpu", "resourceClaimTemplateName": name}],
             "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                             "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}})


def gpus_seen(cluster: Cluster, pod: str) -> list[str]:
    out = cluster.kubectl("exec", pod, "--", "sh", "-c", "ls /dev | grep -E '^nvidia[0-9]+$' || true")
    return sorted(out.split())


def pending_reason(cluster: Cluster, pod: str) -> str | None:
    conditions = cluster.pod(pod)["status"].get("conditions", [])
    return next((c.get("message", "") for c in conditions
                 if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message")), None)


def test_the_gpus_are_published_shareable(cluster: Cluster) -> None:
    gpu = published(cluster)[GPU]
    assert gpu["allowMultipleAllocations"] is True
    assert gpu["capacity"]["memory"]["value"] == "40Gi" and gpu["capacity"]["shares"]["value"] == "4"


def test_two_claims_share_one_gpu_and_a_third_beyond_its_memory_waits(cluster: Cluster) -> None:
    from devinject.nodestate.ledger import Ledger

    memory_pod(cluster, "share-a", "16Gi", pinned=True)
    memory_pod(cluster, "share-b", "16Gi", pinned=True)
    cluster.until_running("share-a")
    cluster.until_running("share-b")
    claims = [cluster.claim_of(p) for p in ("share-a", "share-b")]
    results = [c["status"]["allocation"]["devices"]["results"] for c in claims]
    assert [[r["device"] for r in rs] for rs in results] == [[GPU], [GPU]], results
    share_ids = [rs[0]["shareID"] for rs in results]
    assert len(set(share_ids)) == 2 and all(share_ids), results
    assert [rs[0]["consumedCapacity"]["memory"] for rs in results] == ["16Gi", "16Gi"], results
    seen = [gpus_seen(cluster, p) for p in ("share-a", "share-b")]
    assert seen[0] == seen[1] and len(seen[0]) == 1, seen  # the same one GPU in both pods
    for claim, share in zip(claims, share_ids, strict=True):
        spec = json.loads((CDI / f"{DRIVER}-{claim['metadata']['uid']}.json").read_text())
        assert [d["name"] for d in spec["devices"]] == [f"{claim['metadata']['uid']}-{GPU}-{share}"]
    allocations = Ledger(str(STATE)).snapshot()["allocations"]
    shares = [allocations[f"dra-claim:{DRIVER}:{c['metadata']['uid']}"]["consumes"] for c in claims]
    assert [next(iter(s.values()))["memory"] for s in shares] == [[16 * 2**30, 40 * 2**30]] * 2, shares

    memory_pod(cluster, "share-c", "16Gi", pinned=True)  # 8Gi left of that GPU
    message = until(lambda: pending_reason(cluster, "share-c"), 60, "the scheduler's reason for share-c")
    assert "cannot allocate all claims" in message, message
    memory_pod(cluster, "share-d", "16Gi", pinned=False)  # any GPU: another one
    cluster.until_running("share-d")
    (elsewhere,) = cluster.claim_of("share-d")["status"]["allocation"]["devices"]["results"]
    assert elsewhere["device"] != GPU, elsewhere
    assert cluster.pod("share-c")["status"]["phase"] == "Pending"

    cluster.delete_pod("share-b")  # room again: the third runs on the GPU
    cluster.until_running("share-c", 120, "pod share-c Running once share-b is gone")
    assert cluster.claim_of("share-c")["status"]["allocation"]["devices"]["results"][0]["device"] == GPU
    for pod in ("share-a", "share-c", "share-d"):
        cluster.delete_pod(pod)
