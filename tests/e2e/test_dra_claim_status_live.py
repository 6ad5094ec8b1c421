"""A prepared claim's `status.devices` on the real control plane (test_dra_live.py's cluster, Kubernetes 1.36:
DRAResourceClaimDeviceStatus beta and on, its granular status authorization on): a GPU+NIC claim's pod runs,
and the claim says both devices Ready, the NIC with its interface name and hardware address as the node's
sysfs has them (a netdev added under each NIC function of the fixture host); the pod gone, the driver's
entries go. Then the driver as the shipped RBAC lets its service account act, with a token bound to a pod
on the node (as the DaemonSet's pod has): its status writes are allowed (resourceclaims/status patch and
resourceclaims/driver associated-node:patch), and nothing more was needed. With `--device-metadata`
(KEP-5304), the same GPU+NIC claim's pod reads a metadata.json per request, read-only, naming the devices it
got with their slice's attributes; the pod gone, the files go.

A missing prerequisite fails, never skips. Run it under the cluster lock:
`flock /tmp/devinject-kube.lock .venv/bin/pytest -q tests/e2e/test_dra_claim_status_live.py`."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import REPO
from tests.e2e.kube import until
from tests.e2e.test_dra_live import DRIVER, HOST, KUBE_DIR, SLEEPER, Cluster
from tests.e2e.test_dra_live import cluster as base_cluster

cluster = base_cluster  # the cluster of test_dra_live.py's fixture, for this module

pytestmark = pytest.mark.live

NAMESPACE, ACCOUNT = "devinject-system", "devinject-dra"


@pytest.fixture(scope="module")
def netdevs(cluster: Cluster) -> Iterator[dict[str, dict[str, str]]]:
    """A netdev under each NIC function of the host (ib<n>, a made-up address): PCI address -> networkData."""
    made: dict[str, dict[str, str]] = {}
    functions = sorted(p for p in (HOST / "sys/bus/pci/devices").iterdir() if (p / "infiniband").exists())
    for n, function in enumerate(functions):
        net = function.resolve() / "net" / f"ib{n}"
        net.mkdir(parents=True)
        address = f"b8:3f:d2:00:00:{n:02x}"
        (net / "address").write_text(address + "\n")
        made[function.name] = {"interfaceName": f"ib{n}", "hardwareAddress": address}
    assert made, "the host's NICs"
    yield made
    for function in functions:
        shutil.rmtree(function.resolve() / "net", ignore_errors=True)


def claim_and_pod(cluster: Cluster, name: str) -> None:
    """A ResourceClaim of its own (it outlives the pod, so its status is seen after the unprepare) for a GPU
    and a NIC, and a pod that uses it."""
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
         "spec": {"devices": {"requests": [
             {"name": "gpu", "exactly": {"deviceClassName": "gpu.devinject.io"}},
             {"name": "nic", "exactly": {"deviceClassName": "nic.devinject.io"}}]}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
         "spec": {"terminationGracePeriodSeconds": 1,
                  "resourceClaims": [{"name": "devices", "resourceClaimName": name}],
                  "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                                  "command": SLEEPER, "resources": {"claims": [{"name": "devices"}]}}]}})


def ours(cluster: Cluster, name: str) -> dict[str, dict[str, Any]]:
    claim = cluster.json("resourceclaim", name)
    return {e["device"]: e for e in claim.get("status", {}).get("devices") or [] if e.get("driver") == DRIVER}


def check_status(cluster: Cluster, name: str, netdevs: dict[str, dict[str, str]]) -> None:
    claim_and_pod(cluster, name)
    cluster.until_running(name)
    results = cluster.json("resourceclaim", name)["status"]["allocation"]["devices"]["results"]
    entries = until(lambda: ours(cluster, name) if len(ours(cluster, name)) == 2 else None, 60,
                    f"claim {name}'s status.devices written")
    assert set(entries) == {r["device"] for r in results}
    for device, entry in entries.items():
        assert entry["pool"] == next(r["pool"] for r in results if r["device"] == device)
        (ready,) = entry["conditions"]
        assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared"), entry
    nic = next(d for d in entries if d.startswith("rdma-"))
    address = next(a for a in netdevs if a.replace(":", "-").replace(".", "-") in nic)
    assert entries[nic]["networkData"] == netdevs[address], entries[nic]
    gpu = next(d for d in entries if d.startswith("gpu-"))
    assert "networkData" not in entries[gpu]
    cluster.delete_pod(name)
    until(lambda: not ours(cluster, name), 60, f"the driver's entries of claim {name} removed (unprepared)")
    cluster.kubectl("delete", "resourceclaim", name, "--wait=true")
    assert "device status not" not in cluster.log.read_text()


def test_a_gpu_and_nic_claim_shows_both_devices_and_the_nics_interface(
        cluster: Cluster, netdevs: dict[str, dict[str, str]]) -> None:
    check_status(cluster, "status-admin", netdevs)


def test_the_shipped_rbac_is_all_the_driver_needs_for_its_claims_status(
        cluster: Cluster, netdevs: dict[str, dict[str, str]]) -> None:
    """The driver with a token of its service account bound to a pod on the node (the DaemonSet's: the
    granular authorization allows resourceclaims/driver associated-node:patch only with the node in it)."""
    cluster.kubectl("apply", "-f", str(REPO / "deploy/kubernetes/dra/namespace.yaml"),
                    "-f", str(REPO / "deploy/kubernetes/dra/rbac.yaml"))
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "driver-identity", "namespace": NAMESPACE},
                   "spec": {"serviceAccountName": ACCOUNT, "nodeName": cluster.node, "terminationGracePeriodSeconds": 1,
                            "containers": [{"name": "c", "image": "localhost/busybox:1",
                                            "imagePullPolicy": "Never", "command": SLEEPER}]}})
    token = cluster.kubectl("create", "token", ACCOUNT, "-n", NAMESPACE, "--bound-object-kind", "Pod",
                            "--bound-object-name", "driver-identity", "--duration", "30m").strip()
    admin = yaml.safe_load((KUBE_DIR / "admin.kubeconfig").read_text())
    server = admin["clusters"][0]["cluster"]
    ca = server.get("certificate-authority-data") or base64.b64encode(
        Path(server["certificate-authority"]).read_bytes()).decode()
    config = KUBE_DIR / "driver-sa.kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "driver",
        "clusters": [{"name": "c", "cluster": {"server": server["server"], "certificate-authority-data": ca}}],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "driver", "context": {"cluster": "c", "user": ACCOUNT}}]}))
    cluster.stop_driver()
    try:
        cluster.start_driver("--kubeconfig", str(config))  # the last --kubeconfig is the one used
        check_status(cluster, "status-account", netdevs)
    finally:
        cluster.stop_driver()
        cluster.start_driver()
        cluster.kubectl("delete", "pod", "driver-identity", "-n", NAMESPACE, "--grace-period=1", "--wait=false")


def test_a_gpu_and_nic_claims_pod_reads_both_devices_metadata(cluster: Cluster) -> None:
    """KEP-5304 with --device-metadata (the shipped DaemonSet's): the pod finds a metadata.json per request at
    the documented path, each naming the device the claim got there with its slice's attributes."""
    cluster.stop_driver()
    try:
        cluster.start_driver("--device-metadata")
        claim_and_pod(cluster, "metadata")
        cluster.until_running("metadata")
        claim = cluster.json("resourceclaim", "metadata")
        results = {r["request"]: r for r in claim["status"]["allocation"]["devices"]["results"]}
        base = "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/metadata"
        published = {d["name"]: d for s in cluster.slices() for d in s["spec"].get("devices", [])}
        for request in ("gpu", "nic"):
            text = cluster.kubectl("exec", "metadata", "--", "cat", f"{base}/{request}/{DRIVER}-metadata.json")
            document = json.loads(text)
            assert document["kind"] == "DeviceMetadata" and document["metadata"]["uid"] == claim["metadata"]["uid"]
            (entry,) = document["requests"]
            (device,) = entry["devices"]
            assert (entry["name"], device["name"], device["pool"]) == (
                request, results[request]["device"], results[request]["pool"])
            assert device["attributes"] == published[device["name"]]["attributes"]
            assert "resource.kubernetes.io/pciBusID" in device["attributes"]
        written = cluster.kubectl("exec", "metadata", "--", "sh", "-c",
                                  f"echo x > {base}/gpu/{DRIVER}-metadata.json 2>&1 || echo refused")
        assert "refused" in written  # read-only in the container
        cluster.delete_pod("metadata")
        directory = Path("/var/lib/kubelet/plugins") / DRIVER / "dra-device-metadata" / claim["metadata"]["uid"]
        until(lambda: not directory.exists(), 60, "the claim's metadata removed (unprepared)")
        cluster.kubectl("delete", "resourceclaim", "metadata", "--wait=true")
    finally:
        cluster.stop_driver()
        cluster.start_driver()
