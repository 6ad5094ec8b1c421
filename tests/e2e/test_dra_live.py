"""`devinject dra-driver` on the real control plane (../shared/kube/cluster-up.sh with CONTAINERD=bundled:
containerd 1.7 applies CDI), run on the host with the admin kubeconfig as the cluster's README says, over the
4-switch HGX tree (tests/fixtures/topologies/hgx-h100-4sw.yaml: two GPUs and a NIC under each of four host
bridges) built with real char nodes, and two IMEX channels (real nodes, their region in /proc/devices).

Through the API and the real scheduler: the slices published and read back; a claim for 2 GPUs with
`matchAttribute: resource.kubernetes.io/pcieRoot` gets two GPUs under one root and the pod sees exactly their
nodes; a GPU+NIC claim gets a co-located pair; a claim no root can meet leaves its pod Pending with the
scheduler's reason; deleting the pod unprepares the claim (its spec goes); the driver restarted mid-life keeps
the prepared claim and cleans it when the pod goes, and books it again over its running pod after a ledger
rebuild. The driver runs alone, as on a DRA-only node, with its own health loop: a fatal Xid taints the GPU
(the scheduler skips it, the pod's resource health says Unhealthy, put-back clears it), and with NoExecute
opted in the pod on it is evicted by the real controller-manager and replaced on a healthy GPU.

A missing prerequisite fails, never skips. The cluster is always taken down (`cluster-down.sh --purge`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO, terminate
from tests.e2e.kube import KUBE, KubeClient, need, until
from tests.e2e.podphases import race_the_reference, record
from tests.fixtures.build_hosts import DYN
from tests.fixtures.pcie_hosts import build_topology_host

pytestmark = pytest.mark.live

KUBE_DIR = Path("/tmp/devinject-dra-test")
HOST = Path("/var/lib/devinject-dra-test/host")
STATE = Path("/run/devinject-dra-test")
CDI = Path("/var/run/cdi")
DRIVER = "dra.devinject.io"
DEVINJECT = str(Path(sys.executable).parent / "devinject")
SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; sleep 3600 & wait']
ROOT = "resource.kubernetes.io/pcieRoot"
IMEX_MAJOR = DYN["nvidia-caps-imex-channels"]
KERNEL_LOG = HOST / "var/log/kern.log"


class Cluster(KubeClient):
    def __init__(self) -> None:
        super().__init__(KUBE_DIR, "bundled")
        self.node = ""
        self.driver: subprocess.Popen[bytes] | None = None
        self.log = KUBE_DIR / "logs" / "devinject-dra-driver.log"

    def start_driver(self, *extra: str) -> None:
        """The driver alone, as on a DRA-only node: its own health loop (fast timings) reads the host's
        kernel log (HOST/var/log/kern.log). Back once its slices are published and the kubelet has registered
        it (a pod made before that waits on the kubelet's retry, or on nothing if the registration failed)."""
        since = self.log.stat().st_size if self.log.exists() else 0
        handle = open(self.log, "ab")  # noqa: SIM115 - the driver's own log, kept for the report
        self.driver = subprocess.Popen(
            [DEVINJECT, "dra-driver", "--host-root", str(HOST), "--node-name", self.node, "--kubeconfig",
             str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(STATE), "--hook-path", DEVINJECT,
             "--rescan", "2", "--health", "check", "--test-timings", "--interval", "1", "--recheck", "0.5",
             "--threshold", "2", "--no-uevents", *extra], stdout=handle, stderr=handle, stdin=subprocess.DEVNULL)
        handle.close()
        until(lambda: self.slices(), 60, "the driver's ResourceSlices")
        until(lambda: b"registered with the kubelet" in self.log.read_bytes()[since:], 60,
              "the kubelet's registration of the driver (its log)")

    def stop_driver(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            self.driver.send_signal(signal.SIGTERM)
            try:
                self.driver.wait(15)
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait(5)
        self.driver = None

    def slices(self) -> list[dict[str, Any]]:
        items = self.json("resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
        return items  # type: ignore[no-any-return]

    def pod(self, name: str) -> dict[str, Any]:
        return self.json("pod", name)  # type: ignore[no-any-return]

    def running(self, name: str) -> dict[str, Any] | None:
        pod = self.pod(name)
        return pod if pod["status"].get("phase") == "Running" else None

    def until_running(self, name: str, timeout: float = 120, what: str | None = None) -> dict[str, Any]:
        """Pod `name` once Running; past `timeout` s an AssertionError saying why it is not (`why_not_running`)."""
        try:
            return until(lambda: self.running(name), timeout, what or f"pod {name} Running")
        except AssertionError as err:
            raise AssertionError(f"{err}; {self.why_not_running(name)}") from None

    def why_not_running(self, name: str) -> str:
        """For a failure's message: the pod's phase, conditions, waiting containers and latest events, its
        claims' allocations, and whether the driver runs, with its log's last lines."""
        pod = self.pod(name)
        status = pod["status"]
        conditions = [f"{c['type']}={c['status']}" + (f" ({c['message'][:200]})" if c.get("message") else "")
                      for c in status.get("conditions", [])]
        waiting = [f"{c['name']}: {c['state']['waiting'].get('reason')} {c['state']['waiting'].get('message', '')}"
                   for c in status.get("containerStatuses", []) if "waiting" in c.get("state", {})]
        events = self.json("events", "--field-selector", f"involvedObject.name={name}")["items"]
        said = [f"{e['reason']}: {e.get('message', '')[:300]}" for e in events[-5:]]
        claims = []
        for entry in status.get("resourceClaimStatuses", []):
            claim = self.json("resourceclaim", entry["resourceClaimName"])
            allocation = claim.get("status", {}).get("allocation", {}).get("devices", {}).get("results")
            claims.append(f"{entry['resourceClaimName']}: allocated {allocation}, reserved for "
                          f"{[r.get('name') for r in claim.get('status', {}).get('reservedFor', [])]}")
        driver = "not started" if self.driver is None else \
            ("running" if self.driver.poll() is None else f"exited {self.driver.returncode}")
        log = self.log.read_text(errors="replace").splitlines()[-15:] if self.log.exists() else []
        return (f"phase {status.get('phase')}, node {pod['spec'].get('nodeName')}; conditions {conditions}; "
                f"waiting {waiting}; events {said}; claims {claims}; driver {driver}; its log ends:\n"
                + "\n".join(log))

    def claim_of(self, pod: str) -> dict[str, Any]:
        status = self.pod(pod)["status"]
        (entry,) = status["resourceClaimStatuses"]
        return self.json("resourceclaim", entry["resourceClaimName"])  # type: ignore[no-any-return]

    def delete_pod(self, name: str) -> None:
        self.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true", timeout=120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    need(os.geteuid() == 0, "needs root")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh")
    shutil.rmtree(HOST.parent, ignore_errors=True)
    host = build_topology_host("hgx-h100-4sw", HOST, real_nodes=True)
    host.region(IMEX_MAJOR, "nvidia-caps-imex-channels")  # two IMEX channels too, as test_kubelet_live's host
    for channel in (0, 1):
        host.node(f"nvidia-caps-imex-channels/channel{channel}", IMEX_MAJOR, channel)
    host.finish(ldconfig=False)  # /proc/devices with their region
    (HOST / "var/log").mkdir(parents=True, exist_ok=True)
    KERNEL_LOG.write_text("kernel: Linux version 6.1.0\n")  # the health loop reads it (an Xid: a fault)
    for directory in (HOST.parent, HOST):
        directory.chmod(0o755)
    cluster = Cluster()
    try:
        up = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=cluster.env,
                            timeout=600)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        cluster.node = cluster.json("nodes")["items"][0]["metadata"]["name"]
        cluster.log.parent.mkdir(parents=True, exist_ok=True)
        cluster.apply(*[{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                         "metadata": {"name": name},
                         "spec": {"selectors": [{"cel": {"expression":
                                  f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].kind == "{kind}"'}}]}}
                        for name, kind in (("gpu.devinject.io", "nvidia.com/gpu"),
                                           ("nic.devinject.io", "nvidia.com/rdma"),
                                           ("imex.devinject.io", "nvidia.com/imex-channel"))])
        cluster.start_driver()
        yield cluster
    finally:
        cluster.stop_driver()
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=cluster.env,
                       timeout=300)
        shutil.rmtree(HOST.parent, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def claim_pod(cluster: Cluster, name: str, requests: list[tuple[str, str, int]], *, match: bool = True) -> None:
    """A pod with a ResourceClaimTemplate of `requests` (name, class, count), all under one pcieRoot when
    `match`; the container lists its /dev/nvidia* and /dev/infiniband nodes."""
    spec: dict[str, Any] = {"devices": {"requests": [
        {"name": r, "exactly": {"deviceClassName": c, "count": n, "allocationMode": "ExactCount"}}
        for r, c, n in requests]}}
    if match:
        spec["devices"]["constraints"] = [{"requests": [r for r, _, _ in requests], "matchAttribute": ROOT}]
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
         "spec": {"spec": spec}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
         "spec": {"terminationGracePeriodSeconds": 1, "resourceClaims": [
             {"name": "devices", "resourceClaimTemplateName": name}],
             "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                             "command": SLEEPER, "resources": {"claims": [{"name": "devices"}]}}]}})


def devices_seen(cluster: Cluster, pod: str) -> list[str]:
    out = cluster.kubectl("exec", pod, "--", "sh", "-c", "ls /dev | grep -E '^nvidia[0-9]+$' || true")
    return sorted(out.split())


def published(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in cluster.slices() for d in s["spec"].get("devices", [])}


def test_slices_are_published_and_read_back(cluster: Cluster) -> None:
    slices = cluster.slices()
    pools = {s["spec"]["pool"]["name"] for s in slices}
    assert pools == {f"{cluster.node}-nvidia-com-gpu", f"{cluster.node}-nvidia-com-rdma",
                     f"{cluster.node}-nvidia-com-imex-channel"}
    assert all(s["spec"]["nodeName"] == cluster.node for s in slices)
    devices = published(cluster)
    assert len([n for n in devices if n.startswith("gpu-")]) == 8 and len(devices) == 14
    assert devices["channel-1"]["attributes"] == {
        "kind": {"string": "nvidia.com/imex-channel"}, "vendor": {"string": "NVIDIA"}, "type": {"string": "channel"},
        "id": {"int": 1}, "partition": {"string": "whole"}}
    gpu = devices["gpu-0000-18-00-0"]["attributes"]
    assert gpu[ROOT] == {"string": "pci0000:15"}
    assert gpu["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert devices["rdma-0000-1a-00-0"]["attributes"][ROOT] == gpu[ROOT]


def test_two_gpus_under_one_root_and_the_pod_sees_exactly_them(cluster: Cluster) -> None:
    claim_pod(cluster, "two-gpus", [("gpus", "gpu.devinject.io", 2)])
    cluster.until_running("two-gpus")
    claim = cluster.claim_of("two-gpus")
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 2 and {r["driver"] for r in results} == {DRIVER}
    devices = published(cluster)
    roots = {devices[r["device"]]["attributes"][ROOT]["string"] for r in results}
    assert len(roots) == 1, results
    spec = json.loads((CDI / f"{DRIVER}-{claim['metadata']['uid']}.json").read_text())
    expected = sorted(n["path"].removeprefix("/dev/") for d in spec["devices"]
                      for n in d["containerEdits"]["deviceNodes"])
    assert len(expected) == 2 and devices_seen(cluster, "two-gpus") == expected
    uid = claim["metadata"]["uid"]
    cluster.delete_pod("two-gpus")
    until(lambda: not (CDI / f"{DRIVER}-{uid}.json").exists(), 60, "the claim's spec removed (unprepared)")


def test_a_gpu_and_a_nic_under_one_root(cluster: Cluster) -> None:
    claim_pod(cluster, "pair", [("gpu", "gpu.devinject.io", 1), ("nic", "nic.devinject.io", 1)])
    cluster.until_running("pair")
    results = cluster.claim_of("pair")["status"]["allocation"]["devices"]["results"]
    devices = published(cluster)
    assert sorted(r["device"].split("-")[0] for r in results) == ["gpu", "rdma"]
    assert len({devices[r["device"]]["attributes"][ROOT]["string"] for r in results}) == 1
    cluster.delete_pod("pair")


def test_a_claim_no_root_can_meet_stays_pending_with_the_schedulers_reason(cluster: Cluster) -> None:
    claim_pod(cluster, "three", [("gpus", "gpu.devinject.io", 3)])

    def reason() -> str | None:
        conditions = cluster.pod("three")["status"].get("conditions", [])
        return next((c.get("message", "") for c in conditions
                     if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message")), None)

    message = until(reason, 60, "the scheduler's reason")
    assert "cannot allocate all claims" in message, message
    assert cluster.pod("three")["status"]["phase"] == "Pending"
    cluster.delete_pod("three")


def test_a_restarted_driver_keeps_the_claim_and_cleans_it_on_delete(cluster: Cluster) -> None:
    claim_pod(cluster, "kept", [("gpu", "gpu.devinject.io", 1)], match=False)
    cluster.until_running("kept")
    uid = cluster.claim_of("kept")["metadata"]["uid"]
    spec = CDI / f"{DRIVER}-{uid}.json"
    assert spec.exists()
    cluster.stop_driver()
    cluster.start_driver()
    cluster.delete_pod("kept")
    until(lambda: not spec.exists(), 90, "the claim's spec removed by the restarted driver")


def test_a_claim_is_booked_again_over_its_running_pod_after_a_ledger_rebuild(cluster: Cluster) -> None:
    """Issue 21: the ledger corrupt while a claim's pod runs; the next access rebuilds it from live evidence,
    which books the pod's container (its device cgroup grants the GPU) with its pod, read from its cgroup,
    and from the claims' own copy (ledger-claims.json), which keeps the claim. With that copy lost too, the DRA
    checkpoint keeps it, and the restarted driver finds it booked (it was refused, "its devices are not in the
    ledger", and the GPU looked free to the hook once that container ended). A process in no pod is refused
    it either way."""
    from devinject.core.errors import LedgerError
    from devinject.nodestate.ledger import Claim, Ledger

    claim_pod(cluster, "rebuilt", [("gpu", "gpu.devinject.io", 1)], match=False)
    try:
        cluster.until_running("rebuilt")
        pod_uid = cluster.pod("rebuilt")["metadata"]["uid"]
        uid = cluster.claim_of("rebuilt")["metadata"]["uid"]
        (device,) = json.loads((CDI / f"{DRIVER}-{uid}.json").read_text())["devices"]
        (gpu,) = device["containerEdits"]["deviceNodes"]
        node, booking = f"c {gpu['major']}:{gpu['minor']}", f"dra-claim:{DRIVER}:{uid}"
        cluster.stop_driver()
        (STATE / "ledger.json").write_text('{"allocations": {"c1": {"exclus')
        rebuilt = Ledger(str(STATE)).snapshot()["allocations"]
        assert rebuilt[booking]["pods"] == [pod_uid]  # kept: no driver round needed
        assert {e.get("pod") for n, e in rebuilt.items() if n != booking and node in e["exclusive"]} == {pod_uid}
        (STATE / "ledger.json").write_text('{"allocations": {"c1": {"exclus')
        (STATE / "ledger-claims.json").unlink()
        rebuilt = Ledger(str(STATE)).snapshot()["allocations"]
        # both copies lost: the rebuild reads the DRA checkpoint, which keeps the claim at once (it did not: a
        # process in no pod could book the claim's GPU until the driver's next round)
        assert booking in rebuilt, rebuilt
        assert {e.get("pod") for n, e in rebuilt.items() if n != booking and node in e["exclusive"]} == {pod_uid}, \
            rebuilt
        logged = cluster.log.stat().st_size
        cluster.start_driver()
        until(lambda: booking in Ledger(str(STATE)).snapshot()["allocations"], 30, "the claim booked again")
        with open(cluster.log, "rb") as handle:
            handle.seek(logged)
            assert b"its devices are not in the ledger" not in handle.read()
        with pytest.raises(LedgerError, match=f"device {node} is held by container"):
            Ledger(str(STATE)).book("hook-style", os.getpid(), (Claim("nvidia.com/gpu=0", (node,)),))
    finally:
        if cluster.driver is None:
            cluster.start_driver()  # the pod's claim is unprepared by it, and the next tests need it
        cluster.delete_pod("rebuilt")


def test_pod_to_running_against_the_reference_driver(cluster: Cluster) -> None:
    """The same one-device pod with devinject's driver and with Kubernetes' own dra-test-driver, in one run.
    This host has no driver libraries: the claim spec names device nodes and env, and no hook."""
    spec = race_the_reference(cluster, cluster.node, "gpu.devinject.io", "pod_running")
    assert spec[0] > 0 and spec[1] > 0


def test_publish_time_for_the_1024_device_synthetic_host(cluster: Cluster, tmp_path: Path) -> None:
    """The slices of bench_generate's 1,024-device host (8 ConnectX PFs x 127 VFs) through the API server,
    for a node name of their own, then removed."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_generate import synthetic_host

    from devinject.discovery.node import Node
    from devinject.dra.publisher import SlicePublisher, api_client
    from devinject.dra.slices import offers, resource_slices

    root = tmp_path / "synthetic"
    assert synthetic_host(root, 127) == 1024
    publisher = SlicePublisher(api_client(str(KUBE_DIR / "admin.kubeconfig")), DRIVER, "synthetic-node")
    start = time.monotonic()
    desired = resource_slices(DRIVER, "synthetic-node", offers(Node(str(root), check=False), "synthetic-node"))
    built = time.monotonic()
    publisher.publish(desired)
    done = time.monotonic()
    try:
        read = [s for s in cluster.slices() if s["spec"]["nodeName"] == "synthetic-node"]
        assert sum(len(s["spec"]["devices"]) for s in read) == 1024
    finally:
        publisher.remove_all()
    record("synthetic_1024_build_s", round(built - start, 2))
    record("synthetic_1024_publish_s", round(done - built, 2))


def test_driver_rss(cluster: Cluster) -> None:
    assert cluster.driver is not None and cluster.driver.poll() is None, "the driver died"
    status = Path(f"/proc/{cluster.driver.pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    record("driver_rss_mib", round(rss / 1024, 1))


SHIPPED_CLASSES = str(REPO / "deploy" / "kubernetes" / "dra" / "deviceclasses.yaml")


def extended_pod(cluster: Cluster, name: str, resource: str) -> dict[str, Any]:
    """The shipped DeviceClasses applied and a pod asking only `limits: {<resource>: 1}` (no claim of its own,
    no device plugin on the node), Running: the one allocation result of its extended-resource claim."""
    cluster.kubectl("apply", "-f", SHIPPED_CLASSES)
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                   "spec": {"terminationGracePeriodSeconds": 1, "containers": [
                       {"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never", "command": SLEEPER,
                        "resources": {"limits": {resource: "1"}}}]}})
    cluster.until_running(name)
    claim_name = cluster.pod(name)["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    (result,) = cluster.json("resourceclaim", claim_name)["status"]["allocation"]["devices"]["results"]
    return result  # type: ignore[no-any-return]


def test_the_shipped_device_classes_serve_an_unchanged_extended_resource_pod(cluster: Cluster) -> None:
    """deploy/kubernetes/dra/deviceclasses.yaml applied as shipped; a pod asking `limits: {nvidia.com/gpu: 1}`
    (no claim of its own, no device plugin on the node) is given one whole GPU by DRA."""
    try:
        result = extended_pod(cluster, "extended", "nvidia.com/gpu")
        assert result["driver"] == DRIVER and result["device"].startswith("gpu-")
        assert len(devices_seen(cluster, "extended")) == 1
    finally:
        cluster.delete_pod("extended")
        cluster.kubectl("delete", "-f", SHIPPED_CLASSES)


MIG_DRIVER = "mig.devinject.io"
MIG_GPU = 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:07:00.0"'


def selector_pod(cluster: Cluster, name: str, device_class: str, expression: str) -> None:
    request = {"name": "dev", "exactly": {"deviceClassName": device_class, "count": 1, "allocationMode": "ExactCount",
                                          "selectors": [{"cel": {"expression": expression}}]}}
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
         "spec": {"spec": {"devices": {"requests": [request]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
         "spec": {"terminationGracePeriodSeconds": 1, "resourceClaims": [
             {"name": "devices", "resourceClaimTemplateName": name}],
             "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                             "command": SLEEPER, "resources": {"claims": [{"name": "devices"}]}}]}})


def test_a_mig_instance_and_its_whole_gpu_are_never_both_allocated(cluster: Cluster) -> None:
    """A second driver (its own name, state dir and sockets) over the DGX A100 fixture, whose first GPU has
    two MIG instances: while a pod holds the whole GPU, a pod asking for one of its instances stays Pending
    (the shared counters), and it runs once the whole GPU is free; two instances go to two pods at once."""
    state = STATE.with_name(STATE.name + "-mig")
    log = open(KUBE_DIR / "logs" / "devinject-dra-mig.log", "ab")  # noqa: SIM115
    mig = subprocess.Popen(
        [DEVINJECT, "dra-driver", "--host-root", str(REPO / "tests" / "fixtures" / "hosts" / "dgx-a100-mig"),
         "--node-name", cluster.node, "--kubeconfig", str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(state),
         "--hook-path", DEVINJECT, "--driver-name", MIG_DRIVER, "--rescan", "2",
         "--metrics-address", "127.0.0.1:0"],  # beside the first driver, which has the default port
        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    log.close()
    try:
        cluster.apply(*[{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{MIG_DRIVER}" && '
                                                 f'device.attributes["{MIG_DRIVER}"].kind == "nvidia.com/gpu" && '
                                                 f'device.attributes["{MIG_DRIVER}"].partition == "{part}"'}}]}}
                        for name, part in (("whole.mig.devinject.io", "whole"), ("mig.mig.devinject.io", "mig"))])
        until(lambda: cluster.json("resourceslices", "--field-selector", f"spec.driver={MIG_DRIVER}")["items"],
              60, "the MIG driver's slices")
        selector_pod(cluster, "whole", "whole.mig.devinject.io", MIG_GPU)
        cluster.until_running("whole")
        selector_pod(cluster, "instance", "mig.mig.devinject.io", MIG_GPU)

        def reason() -> str | None:
            conditions = cluster.pod("instance")["status"].get("conditions", [])
            return next((c.get("message", "") for c in conditions
                         if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message")), None)

        assert "cannot allocate all claims" in until(reason, 60, "the scheduler's reason for pod instance")
        cluster.delete_pod("whole")
        cluster.until_running("instance", 120, "pod instance Running once the whole GPU is free")
        selector_pod(cluster, "instance2", "mig.mig.devinject.io", MIG_GPU)
        cluster.until_running("instance2", 120, "pod instance2 Running beside instance")
        devices = {cluster.claim_of(p)["status"]["allocation"]["devices"]["results"][0]["device"]
                   for p in ("instance", "instance2")}
        assert devices == {"gpu-0000-07-00-0-gi1-ci0", "gpu-0000-07-00-0-gi2-ci0"}
        cluster.delete_pod("instance")
        cluster.delete_pod("instance2")
    finally:
        mig.send_signal(signal.SIGTERM)
        try:
            mig.wait(15)
        except subprocess.TimeoutExpired:
            mig.kill()
        shutil.rmtree(state, ignore_errors=True)


NVML_DRIVER = "nvml.devinject.io"


def test_claims_select_by_nvmls_memory_and_compute_capability(cluster: Cluster, nvml_stubs) -> None:  # type: ignore[no-untyped-def]
    """A third driver (its own name, state dir and sockets) over the HGX H100 fixture whose libnvidia-ml is the
    stub built from its data (tests/nvmlstub), with --nvml: a claim whose CEL asks for 40Gi of memory and
    compute capability 9.0 (the names NVIDIA's DRA driver publishes) gets an H100; one asking for 100Gi stays
    Pending with the scheduler's reason."""
    from tests.nvmlstub import install_stub

    host = KUBE_DIR / "nvml-host"
    shutil.rmtree(host, ignore_errors=True)
    shutil.copytree(REPO / "tests" / "fixtures" / "hosts" / "hgx-h100", host, symlinks=True)
    install_stub(host, nvml_stubs("hgx-h100"))
    state = STATE.with_name(STATE.name + "-nvml")
    log = open(KUBE_DIR / "logs" / "devinject-dra-nvml.log", "ab")  # noqa: SIM115
    driver = subprocess.Popen(
        [DEVINJECT, "dra-driver", "--host-root", str(host), "--nvml", "--node-name", cluster.node, "--kubeconfig",
         str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(state), "--hook-path", DEVINJECT, "--driver-name",
         NVML_DRIVER, "--kind", "nvidia.com/gpu", "--rescan", "2", "--metrics-address", "127.0.0.1:0"],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    log.close()
    attributes, capacity = f'device.attributes["{NVML_DRIVER}"]', f'device.capacity["{NVML_DRIVER}"]'
    try:
        cluster.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                       "metadata": {"name": "gpu.nvml.devinject.io"},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{NVML_DRIVER}"'}}]}})
        until(lambda: cluster.json("resourceslices", "--field-selector", f"spec.driver={NVML_DRIVER}")["items"],
              60, "the NVML driver's slices")
        selector_pod(cluster, "fits", "gpu.nvml.devinject.io",
                     f'{capacity}.memory.compareTo(quantity("40Gi")) >= 0 && '
                     f'{attributes}.cudaComputeCapability.compareTo(semver("9.0.0")) >= 0 && '
                     f'{attributes}.productName == "NVIDIA H100 80GB HBM3"')
        cluster.until_running("fits")
        (result,) = cluster.claim_of("fits")["status"]["allocation"]["devices"]["results"]
        assert result["driver"] == NVML_DRIVER and result["device"].startswith("gpu-")
        selector_pod(cluster, "too-big", "gpu.nvml.devinject.io",
                     f'{capacity}.memory.compareTo(quantity("100Gi")) >= 0')
        unscheduled = until(lambda: [c["message"] for c in cluster.pod("too-big")["status"].get("conditions", [])
                                     if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message")],
                            60, "the scheduler's reason for pod too-big")
        assert "cannot allocate all claims" in unscheduled[0], unscheduled
        cluster.delete_pod("fits")
        cluster.delete_pod("too-big")
    finally:
        terminate(driver)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(host, ignore_errors=True)


def test_opaque_config_is_a_clear_error_in_the_pods_events_and_nothing_is_left(cluster: Cluster) -> None:
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "opaque"},
         "spec": {"spec": {"devices": {
             "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.devinject.io", "count": 1,
                                                      "allocationMode": "ExactCount"}}],
             "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"mode": "fast"}}}]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "opaque"},
         "spec": {"terminationGracePeriodSeconds": 1, "resourceClaims": [
             {"name": "devices", "resourceClaimTemplateName": "opaque"}],
             "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                             "command": SLEEPER, "resources": {"claims": [{"name": "devices"}]}}]}})
    try:
        def event() -> str | None:
            events = cluster.json("events", "--field-selector", "involvedObject.name=opaque")["items"]
            return next((e["message"] for e in events if ".opaque: " in e.get("message", "")), None)

        message = until(event, 90, "the pod's event with the driver's error")
        assert "config[0].opaque: parameters.'mode': unknown field" in message, message
        assert cluster.pod("opaque")["status"]["phase"] == "Pending"
        assert not [p for p in CDI.glob(f"{DRIVER}-*.json")], "a claim spec was left behind"
    finally:
        cluster.delete_pod("opaque")


def test_a_channel_claim_gives_the_pod_exactly_that_channel(cluster: Cluster) -> None:
    """A claim for one IMEX channel: the pod runs with that channel's node alone, reachable through its device
    cgroup (no driver on the channels' major: ENXIO, not EPERM), the channel booked for the claim; the pod gone,
    its spec goes; a channel whose node is removed is tainted `gone` in the slice, untainted when it is back."""
    from devinject.nodestate.ledger import Ledger

    claim_pod(cluster, "imex", [("channel", "imex.devinject.io", 1)], match=False)
    try:
        cluster.until_running("imex")
        claim = cluster.claim_of("imex")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["pool"] == f"{cluster.node}-nvidia-com-imex-channel" and result["device"].startswith("channel-")
        number = int(result["device"].removeprefix("channel-"))
        uid = claim["metadata"]["uid"]
        (device,) = json.loads((CDI / f"{DRIVER}-{uid}.json").read_text())["devices"]
        assert [(n["path"], n["major"], n["minor"]) for n in device["containerEdits"]["deviceNodes"]] == \
            [(f"/dev/nvidia-caps-imex-channels/channel{number}", IMEX_MAJOR, number)]
        listed = cluster.kubectl("exec", "imex", "--", "ls", "/dev/nvidia-caps-imex-channels")
        assert listed.split() == [f"channel{number}"], listed
        path = f"/dev/nvidia-caps-imex-channels/channel{number}"
        opened = cluster.kubectl("exec", "imex", "--", "sh", "-c", f"cat {path} 2>&1; true")
        assert f"can't open '{path}': No such device or address" in opened, opened
        allocations = Ledger(str(STATE)).snapshot()["allocations"]
        assert f"c {IMEX_MAJOR}:{number}" in allocations[f"dra-claim:{DRIVER}:{uid}"]["exclusive"], allocations
    finally:
        cluster.delete_pod("imex")
    until(lambda: not (CDI / f"{DRIVER}-{uid}.json").exists(), 60, "the claim's spec removed (unprepared)")
    node = HOST / "dev/nvidia-caps-imex-channels/channel1"
    node.unlink()
    try:
        until(lambda: taints_of(cluster, "channel-1") == [(f"{DRIVER}/gone", "", "NoSchedule")], 30,
              "channel-1 tainted gone in the slice, its node gone")
        assert taints_of(cluster, "channel-0") == []
    finally:
        os.mknod(node, 0o020666, os.makedev(IMEX_MAJOR, 1))
    until(lambda: taints_of(cluster, "channel-1") == [], 30, "channel-1 back in the slice, untainted")


def test_the_shipped_channel_class_serves_an_unchanged_imex_channel_pod(cluster: Cluster) -> None:
    """deploy/kubernetes/dra/deviceclasses.yaml as shipped: a pod asking `limits: {nvidia.com/imex-channel: 1}`
    (the device plugin's resource, no device plugin on the node) gets one channel through its class."""
    try:
        result = extended_pod(cluster, "imex-extended", "nvidia.com/imex-channel")
        assert result["driver"] == DRIVER and result["device"].startswith("channel-"), result
        listed = cluster.kubectl("exec", "imex-extended", "--", "ls", "/dev/nvidia-caps-imex-channels")
        assert listed.split() == [result["device"].replace("-", "")], listed
    finally:
        cluster.delete_pod("imex-extended")
        cluster.kubectl("delete", "-f", SHIPPED_CLASSES)


def taints_of(cluster: Cluster, device: str) -> list[tuple[str, str, str]]:
    return [(t["key"], t.get("value", ""), t["effect"]) for t in published(cluster)[device].get("taints", [])]


def xid(device: dict[str, Any], code: int = 79) -> None:
    """A fatal Xid for the device, as the NVIDIA driver logs it (syslog appends to kern.log)."""
    slot = device["attributes"]["resource.kubernetes.io/pciBusID"]["string"].rpartition(".")[0]
    with open(KERNEL_LOG, "a") as log:
        log.write(f"kernel: [ 4242.1] NVRM: Xid (PCI:{slot}): {code}, pid=0, GPU has fallen off the bus.\n")


def put_back(device: dict[str, Any]) -> None:
    address = device["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
    done = subprocess.run([DEVINJECT, "put-back", f"nvidia.com/gpu={address}", "--root", str(HOST),
                           "--state-dir", str(STATE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def resource_health(cluster: Cluster, pod: str) -> dict[str, str]:
    out = {}
    for container in cluster.pod(pod)["status"].get("containerStatuses", []):
        for entry in container.get("allocatedResourcesStatus") or []:
            out.update({r["resourceID"]: r.get("health", "") for r in entry.get("resources", [])})
    return out


def test_an_xid_taints_the_gpu_the_scheduler_skips_it_and_put_back_clears_it(cluster: Cluster) -> None:
    """A DRA-only node (the driver alone, its own health loop): a fatal Xid for the GPU a pod holds taints it
    in the slice (`dra.devinject.io/xid`, NoSchedule), puts it Unhealthy in the pod's status
    (ResourceHealthStatus: `allocatedResourcesStatus`, the claim's entry, the device by its CDI id), the pod
    runs on (NoSchedule evicts nothing), and a new claim whose selector admits only that GPU or one other gets
    the other; with only the tainted one admitted it stays Pending. `devinject put-back` clears the taint."""
    claim_pod(cluster, "health", [("gpu", "gpu.devinject.io", 1)], match=False)
    cluster.until_running("health")
    claim = cluster.claim_of("health")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    name = result["device"]
    device = published(cluster)[name]
    other = next(n for n, d in sorted(published(cluster).items()) if n != name
                 and d["attributes"]["kind"]["string"] == "nvidia.com/gpu"
                 and d["attributes"]["partition"]["string"] == "whole")
    resource = f"{DRIVER}/claim={claim['metadata']['uid']}-{name}"  # the kubelet names it by CDI id
    try:
        started = time.monotonic()
        xid(device)
        until(lambda: taints_of(cluster, name) == [(f"{DRIVER}/xid", "79", "NoSchedule")], 30,
              f"{name} tainted xid in its slice", every=0.05)
        record("xid_to_taint_read_back_s", time.monotonic() - started)  # kubectl's own ~0.1 s per read included
        until(lambda: resource_health(cluster, "health").get(resource) == "Unhealthy", 60,
              f"{resource} Unhealthy in pod status")
        assert cluster.running("health")  # NoSchedule: the pod is not evicted
        bus = {n: published(cluster)[n]["attributes"][ROOT.replace("pcieRoot", "pciBusID")]["string"]
               for n in (name, other)}
        pci = 'device.attributes["resource.kubernetes.io"].pciBusID'
        selector_pod(cluster, "skips", "gpu.devinject.io", f'{pci} == "{bus[name]}" || {pci} == "{bus[other]}"')
        cluster.until_running("skips")
        (given,) = cluster.claim_of("skips")["status"]["allocation"]["devices"]["results"]
        assert given["device"] == other, given
        cluster.delete_pod("skips")
        selector_pod(cluster, "only-tainted", "gpu.devinject.io", f'{pci} == "{bus[name]}"')
        time.sleep(10)
        pod = cluster.pod("only-tainted")
        assert pod["status"].get("phase") == "Pending", pod["status"]
        assert not pod["spec"].get("nodeName")
        cluster.delete_pod("only-tainted")
        put_back(device)
        until(lambda: taints_of(cluster, name) == [], 30, f"{name}'s taint cleared by put-back")
        until(lambda: resource_health(cluster, "health").get(resource) == "Healthy", 60, f"{resource} Healthy again")
    finally:
        put_back(device)
        cluster.delete_pod("health")
        for pod in ("skips", "only-tainted"):
            cluster.kubectl("delete", "pod", pod, "--ignore-not-found", "--grace-period=1", "--wait=true",
                            timeout=120)


def test_no_execute_opted_in_evicts_the_pod_and_its_replacement_lands_on_a_healthy_gpu(cluster: Cluster) -> None:
    """`--fatal-taint-effect NoExecute`: a fatal Xid on the GPU a Deployment's pod holds makes
    kube-controller-manager's device-taint eviction (DRADeviceTaints, beta and on in 1.36) evict the pod; its
    replacement, with a new claim from the same template, runs on another GPU."""
    cluster.stop_driver()
    cluster.start_driver("--fatal-taint-effect", "NoExecute")
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "evict"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "gpu.devinject.io", "count": 1, "allocationMode": "ExactCount"}}]}}}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "evict"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "evict"}},
                           "template": {"metadata": {"labels": {"app": "evict"}}, "spec": {
                               "terminationGracePeriodSeconds": 1,
                               "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": "evict"}],
                               "containers": [{"name": "c", "image": "localhost/busybox:1",
                                               "imagePullPolicy": "Never", "command": SLEEPER,
                                               "resources": {"claims": [{"name": "devices"}]}}]}}}}
    device: dict[str, Any] | None = None

    def running_pods() -> list[dict[str, Any]]:
        pods = cluster.json("pods", "-l", "app=evict")["items"]
        return [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]

    def gpu_of(pod: dict[str, Any]) -> str:
        (entry,) = pod["status"]["resourceClaimStatuses"]
        claim = cluster.json("resourceclaim", entry["resourceClaimName"])
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        return str(result["device"])

    try:
        cluster.apply(template, deployment)
        until(lambda: len(running_pods()) == 1, 120, "the Deployment's pod Running")
        (first,) = running_pods()
        name = gpu_of(first)
        device = published(cluster)[name]
        xid(device)
        until(lambda: taints_of(cluster, name) == [(f"{DRIVER}/xid", "79", "NoExecute")], 30,
              f"{name} tainted xid NoExecute")
        until(lambda: [p for p in running_pods() if p["metadata"]["uid"] != first["metadata"]["uid"]], 120,
              "the replacement pod Running")
        (second,) = [p for p in running_pods() if p["metadata"]["uid"] != first["metadata"]["uid"]]
        assert gpu_of(second) != name
        until(lambda: not cluster.json("pods", "--field-selector", f"metadata.name={first['metadata']['name']}")[
            "items"], 60, "the evicted pod gone")
    finally:
        cluster.kubectl("delete", "deployment", "evict", "--ignore-not-found", "--wait=true", timeout=120)
        cluster.kubectl("delete", "resourceclaimtemplate", "evict", "--ignore-not-found", timeout=60)
        if device is not None:
            put_back(device)
        cluster.stop_driver()
        cluster.start_driver()


def test_an_admin_access_claim_never_keeps_the_workload_from_its_gpu(cluster: Cluster) -> None:
    """A monitoring claim (`adminAccess: true`, in a namespace labelled for it) on the GPU a workload then
    claims: the scheduler allocates both, and both pods run with the GPU. Before, the admin claim was booked
    exclusive, and the workload's claim on that GPU was refused `held by` (its pod never started)."""
    address = sorted(d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
                     for n, d in published(cluster).items() if n.startswith("gpu-") and "-gi" not in n)[-1]
    gpu = f'device.attributes["resource.kubernetes.io"].pciBusID == "{address}"'
    namespace = "devinject-monitoring"
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {"resource.kubernetes.io/admin-access": "true"}}})
    request = {"name": "dev", "exactly": {"deviceClassName": "gpu.devinject.io", "count": 1, "adminAccess": True,
                                          "allocationMode": "ExactCount", "selectors": [{"cel": {"expression": gpu}}]}}
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": "monitor", "namespace": namespace},
         "spec": {"spec": {"devices": {"requests": [request]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "monitor", "namespace": namespace},
         "spec": {"terminationGracePeriodSeconds": 1, "resourceClaims": [
             {"name": "devices", "resourceClaimTemplateName": "monitor"}],
             "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                             "command": SLEEPER, "resources": {"claims": [{"name": "devices"}]}}]}})

    def monitor_running() -> bool:
        return cluster.json("pod", "monitor", "-n", namespace)["status"].get("phase") == "Running"

    try:
        until(monitor_running, 120, "the monitoring pod Running")
    except AssertionError as err:
        raise AssertionError(f"{err}: {cluster.kubectl('describe', 'pod', '-n', namespace, 'monitor')[-2500:]}") \
            from None
    selector_pod(cluster, "watched", "gpu.devinject.io", gpu)
    cluster.until_running("watched", 120, "the workload's pod Running beside the admin claim")
    seen = devices_seen(cluster, "watched")
    assert len(seen) == 1, seen
    assert cluster.kubectl("exec", "-n", namespace, "monitor", "--", "ls", "/dev").split().count(seen[0]) == 1
    cluster.delete_pod("watched")
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", timeout=120)
