"""The device plugin and the DRA driver on one node of the real cluster (../shared/kube/cluster-up.sh with
CONTAINERD=v2: containerd 2.3.4 applies CDI, so no devinject hook runs at container start and only the agents'
own bookings keep the two paths apart): the device-plugin DaemonSet as tests/cluster/overlay deploys it
(test_cluster_live.py, which runs on containerd 1.7 and 1.6), its Allocate answering CDI names only
(`--allocate=cdi` added to its args: nothing but containerd 2's CDI can give a pod its GPU), and `devinject
dra-driver` on the host over the same fake HGX host (8 GPUs) and the same state dir (its ledger).

Device-plugin pods and DRA claims' pods on the node, in a mix: never one GPU in two running pods (what each
container sees of /dev/nvidia*), every pod the node has room for Running (none left in ContainerCreating), a
pod beyond what is left Pending with the scheduler's reason, on either path; a device freed on one path
reaches the other's pending pod; all of it again across a restart of both agents and a ledger rebuilt from
evidence (ledger.json corrupt; then it and its claims' copy gone). Figures to build/both-paths-figures.json.

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

from tests.e2e.conftest import REPO
from tests.e2e.kube import KUBE, need, until
from tests.e2e.test_cluster_live import (
    BUSYBOX,
    GPU,
    KUBE_DIR,
    OVERLAY,
    SLEEPER,
    TEST_ROOT,
    Cluster,
    build_fake_host,
    ctr_v2,
    foreign_kubernetes,
    image,  # noqa: F401 - the module fixture: `make image`
    run,
)

pytestmark = pytest.mark.live

HOST = TEST_ROOT / "host"
STATE = TEST_ROOT / "run" / "devinject"  # the overlay's state dir: the agent's, and the driver's here
DRIVER = "dra.devinject.io"
CLASS = "nvidia-gpu.devinject.io"  # the shipped class (deploy/kubernetes/dra/deviceclasses.yaml)
DEVINJECT = str(Path(sys.executable).parent / "devinject")
FIGURES = REPO / "build" / "both-paths-figures.json"


class Node(Cluster):
    def __init__(self) -> None:
        super().__init__("v2")
        self.driver: subprocess.Popen[bytes] | None = None
        self.log = KUBE_DIR / "logs" / "devinject-dra-driver.log"
        self.created: list[str] = []

    def start_driver(self) -> None:
        handle = open(self.log, "ab")  # noqa: SIM115 - the driver's own log, kept for the report
        self.driver = subprocess.Popen(
            [DEVINJECT, "dra-driver", "--host-root", str(HOST), "--node-name", self.node, "--kubeconfig",
             str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(STATE), "--hook-path", DEVINJECT,
             "--rescan", "2"], stdout=handle, stderr=handle, stdin=subprocess.DEVNULL)
        handle.close()
        until(lambda: self.published(), 60, "the driver's ResourceSlices")

    def stop_driver(self, sig: int = signal.SIGTERM) -> None:
        if self.driver is not None and self.driver.poll() is None:
            self.driver.send_signal(sig)
            try:
                self.driver.wait(15)
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait(5)
        self.driver = None

    def logged_since(self, offset: int, text: str, timeout: float) -> None:
        """`text` in the driver's log after byte `offset`, within `timeout` s."""
        def found() -> bool:
            with open(self.log, "rb") as handle:
                handle.seek(offset)
                return text in handle.read().decode(errors="replace")

        until(found, timeout, f"the driver's log saying {text!r}")

    def published(self) -> list[str]:
        """The GPUs in the driver's slices, by device name."""
        items = self.json("resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
        return sorted(d["name"] for s in items for d in s["spec"].get("devices", [])
                      if d["name"].startswith("gpu-"))

    # --- pods ------------------------------------------------------------------------------------------
    def plugin_pod(self, name: str) -> None:
        self.created.append(name)
        self.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"test": "both"}},
                    "spec": {"terminationGracePeriodSeconds": 1, "containers": [
                        {"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never", "command": SLEEPER,
                         "resources": {"limits": {GPU: 1}}}]}})

    def claim_pod(self, name: str) -> None:
        self.created.append(name)
        self.apply(
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
             "spec": {"spec": {"devices": {"requests": [
                 {"name": "gpu", "exactly": {"deviceClassName": CLASS, "count": 1}}]}}}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"test": "both"}},
             "spec": {"terminationGracePeriodSeconds": 1,
                      "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
                      "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                      "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}})

    def delete(self, name: str) -> None:
        self.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true", timeout=120)
        self.kubectl("delete", "resourceclaimtemplate", name, "--ignore-not-found", timeout=60)
        self.created.remove(name)

    def phases(self) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.json("pods", "-l", "test=both")["items"]}

    def running(self, name: str, timeout: float = 90) -> float:
        start = time.monotonic()

        def up() -> bool:
            pod = self.phases().get(name)
            return pod is not None and pod["status"].get("phase") == "Running" and \
                all(c.get("ready") for c in pod["status"].get("containerStatuses", []))

        try:
            until(up, timeout, f"pod {name} Running", every=0.3)
        except AssertionError as err:
            raise AssertionError(f"{err}; {self.diagnosis()}") from None
        return round(time.monotonic() - start, 2)

    def diagnosis(self) -> str:
        """What each path holds and offers now, for a failure's message."""
        bookings = {b: (e.get("exclusive"), e.get("pods")) for b, e in self.ledger().items()}
        pods_dirs = sorted(os.listdir("/var/lib/kubelet/pods")) if os.path.isdir("/var/lib/kubelet/pods") else None
        return (f"stuck: {self.stuck()}; ledger: {bookings}; slices: {self.published()}; allocatable "
                f"{self.allocatable()}; pod dirs {pods_dirs}; pods {sorted(self.phases())}")

    def pending_reason(self, name: str, timeout: float = 60) -> str:
        def reason() -> str | None:
            pod = self.phases()[name]
            conditions = pod["status"].get("conditions", [])
            return next((c.get("message", "") for c in conditions if c["type"] == "PodScheduled"
                         and c["status"] == "False" and c.get("message")), None)

        return until(reason, timeout, f"the scheduler's reason for {name}")

    def stuck(self) -> str:
        """Pods bound to the node but not Running (ContainerCreating, Failed): with their latest events."""
        out = []
        for name, pod in self.phases().items():
            if pod["spec"].get("nodeName") and pod["status"].get("phase") != "Running":
                events = self.json("events", "--field-selector", f"involvedObject.name={name}")["items"]
                said = "; ".join(f"{e['reason']}: {e.get('message', '')[:200]}" for e in events[-3:])
                out.append(f"{name} {pod['status'].get('phase')} [{said}]")
        return ", ".join(out) or "none stuck"

    def seen(self) -> dict[str, set[tuple[int, int]]]:
        """Each Running pod's GPUs as its container sees them: (major, minor) of every /dev/nvidiaN."""
        out = {}
        for name, pod in self.phases().items():
            if pod["status"].get("phase") != "Running":
                continue
            text = self.exec(name, 'for f in /dev/nvidia[0-9]*; do [ -e "$f" ] && stat -c "%t %T" "$f"; done; true')
            out[name] = {(int(a, 16), int(b, 16)) for a, b in (line.split() for line in text.splitlines())}
        return out

    def assert_never_shared(self) -> dict[str, set[tuple[int, int]]]:
        seen = self.seen()
        owners: dict[tuple[int, int], str] = {}
        for name, nodes in seen.items():
            assert len(nodes) == 1, f"{name} sees {nodes}"
            for node in nodes:
                assert node not in owners, f"GPU {node} in two running pods: {owners[node]} and {name}"
                owners[node] = name
        assert not [n for n, p in self.phases().items() if p["spec"].get("nodeName")
                    and p["status"].get("phase") != "Running"], self.stuck()
        return seen

    def ledger(self) -> dict[str, Any]:
        """The ledger's bookings; none while it is missing or broken (before a rebuild)."""
        try:
            return json.loads((STATE / "ledger.json").read_text())["allocations"]  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError):
            return {}


def record(name: str, value: float) -> None:
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    figures[name] = value
    FIGURES.parent.mkdir(exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


def keep_logs(made: Node) -> None:
    """For the report: cluster-down.sh --purge removes the logs."""
    keep = REPO / "build" / "both-paths-logs"
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir(parents=True, exist_ok=True)
    for log in ("devinject-dra-driver.log", "kubelet.log", "kube-scheduler.log"):
        if (KUBE_DIR / "logs" / log).exists():
            shutil.copy(KUBE_DIR / "logs" / log, keep / log)
    agent = made.agent() if made.node else None
    if agent is not None:
        (keep / "device-plugin.log").write_text(made.kubectl(
            "-n", "devinject-system", "logs", agent["metadata"]["name"], "-c", "device-plugin", check=False))
    if (STATE / "ledger.json").exists():
        shutil.copy(STATE / "ledger.json", keep / "ledger.json")


@pytest.fixture(scope="module")
def node(image: Path) -> Iterator[Node]:  # noqa: F811 - the imported fixture
    made = Node()
    others = foreign_kubernetes()
    need(not others, f"the node to itself, but another Kubernetes runs here: {'; '.join(others)}")
    try:
        if any((KUBE_DIR / "run").glob("*.pid")):
            run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        made.gpus = build_fake_host()
        up = run([str(KUBE / "cluster-up.sh")], 900, env=made.env)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        ctr_v2("images", "import", str(image))
        made.node = made.json("nodes")["items"][0]["metadata"]["name"]
        made.kubectl("label", "node", made.node, "devinject.io/accelerators=true", "--overwrite")
        made.kubectl("apply", "-k", str(OVERLAY))
        made.kubectl("-n", "devinject-system", "patch", "daemonset", "devinject", "--type", "json", "-p", json.dumps(
            [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--allocate=cdi"}]))
        made.kubectl("-n", "devinject-system", "rollout", "status", "daemonset/devinject", "--timeout=300s",
                     timeout=320)
        made.await_allocatable(8, 120, "the agent's registration")
        agent = made.agent()
        assert agent is not None and "--allocate=cdi" in agent["spec"]["containers"][0]["args"], agent
        made.kubectl("apply", "-f", str(REPO / "deploy" / "kubernetes" / "dra" / "deviceclasses.yaml"))
        made.log.parent.mkdir(parents=True, exist_ok=True)
        made.start_driver()
        until(lambda: len(made.published()) == 8, 60, "8 GPUs in the slices")
        FIGURES.unlink(missing_ok=True)
        yield made
    finally:
        made.stop_driver()
        try:
            keep_logs(made)
        except Exception as err:  # the cluster is taken down whatever happens here
            print(f"keeping the logs: {err}")
        down = run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        shutil.rmtree(TEST_ROOT, ignore_errors=True)
        assert down.returncode == 0, f"cluster-down.sh --purge failed:\n{down.stdout[-2000:]}{down.stderr[-2000:]}"


def test_half_by_each_path_then_more_than_is_left_by_each(node: Node) -> None:
    order = [("dp-0", "plugin"), ("dra-0", "claim"), ("dra-1", "claim"), ("dp-1", "plugin"), ("dp-2", "plugin"),
             ("dra-2", "claim"), ("dp-3", "plugin"), ("dra-3", "claim")]
    times = []
    for name, path in order:
        (node.plugin_pod if path == "plugin" else node.claim_pod)(name)
        times.append(node.running(name))
    record("pod_to_running_max_s", max(times))
    seen = node.assert_never_shared()
    assert len(set().union(*seen.values())) == 8  # every GPU, each in one pod
    # each path's offer lost the other's four: the kubelet's allocatable, the driver's slices
    start = time.monotonic()
    node.await_allocatable(4, 60, "the claims' GPUs out of the kubelet's count")
    record("claims_out_of_allocatable_s", round(time.monotonic() - start, 2))
    assert len(node.published()) == 4
    bookings = node.ledger()
    assert len([b for b in bookings if b.startswith("device-plugin:")]) == 4
    assert len([b for b in bookings if b.startswith("dra-claim:")]) == 4
    # more than is left, by each path: Pending with the scheduler's reason, never bound
    node.plugin_pod("dp-extra")
    node.claim_pod("dra-extra")
    assert f"Insufficient {GPU}" in node.pending_reason("dp-extra")
    assert "cannot allocate all claims" in node.pending_reason("dra-extra")
    time.sleep(5)
    phases = node.phases()
    assert not phases["dp-extra"]["spec"].get("nodeName") and not phases["dra-extra"]["spec"].get("nodeName")
    free_across(node, "dp-extra", "dp-0", "dra-extra", "dra-0", "dp-more")


def free_across(node: Node, plugin_pending: str, plugin_pod: str, claim_pending: str, claim_pod: str,
                plugin_next: str) -> None:
    """A GPU freed by a device-plugin pod reaches the pending claim's pod; one freed by a claim, a pending
    device-plugin pod. One pending pod at a time: a GPU freed while both paths wait goes to whichever asks
    first (the kubelet gives a device it freed again at once), which is no stuck pod either."""
    node.delete(plugin_pending)
    start = time.monotonic()
    node.delete(plugin_pod)
    node.running(claim_pending, timeout=120)
    record("plugin_gpu_to_claim_s", round(time.monotonic() - start, 2))
    # the scheduler counts the new claim's GPU out of the device plugin's once the kubelet says so
    start = time.monotonic()
    node.await_allocatable(3, 60, "the new claim's GPU out of the kubelet's count")
    record("claim_to_allocatable_s", round(time.monotonic() - start, 2))
    node.plugin_pod(plugin_next)
    assert f"Insufficient {GPU}" in node.pending_reason(plugin_next)
    start = time.monotonic()
    node.delete(claim_pod)
    node.running(plugin_next, timeout=120)
    record("claim_gpu_to_plugin_pod_s", round(time.monotonic() - start, 2))
    seen = node.assert_never_shared()
    assert len(seen) == 8 and len(set().union(*seen.values())) == 8


def test_across_a_restart_of_both_agents_and_a_ledger_rebuild(node: Node) -> None:
    before = node.assert_never_shared()
    assert len(before) == 8
    # both agents restarted: the device plugin's pod deleted (the DaemonSet makes another), the driver killed
    agent = node.agent()
    assert agent is not None
    node.kubectl("-n", "devinject-system", "delete", "pod", agent["metadata"]["name"], "--wait=true", timeout=120)
    node.stop_driver(signal.SIGKILL)
    until(lambda: (a := node.agent()) is not None and a["metadata"]["uid"] != agent["metadata"]["uid"], 120,
          "the agent's new pod Ready")
    node.start_driver()
    # the ledger corrupt: rebuilt from evidence and the bookings' copy; then both copies gone: booked again
    # from the kubelet's checkpoint (the plugin) and the driver's checkpoint (the claims)
    (STATE / "ledger.json").write_text('{"allocations": {"c1": {"exclus')
    until(lambda: len([b for b in node.ledger() if b.startswith("device-plugin:")]) == 4, 30,
          "the plugin's bookings after the rebuild")
    (STATE / "ledger.json").unlink()
    (STATE / "ledger-claims.json").unlink(missing_ok=True)
    start = time.monotonic()

    def rebooked() -> bool:
        bookings = node.ledger()
        return len([b for b in bookings if b.startswith("device-plugin:")]) == 4 and \
            len([b for b in bookings if b.startswith("dra-claim:")]) == 4

    until(rebooked, 30, "both paths' bookings again")
    record("bookings_back_after_ledger_lost_s", round(time.monotonic() - start, 2))
    until(lambda: len(node.published()) == 4, 30, "the plugin's GPUs still out of the slices")
    node.await_allocatable(4, 60, "the claims' GPUs still out of the kubelet's count")
    # the node is still full on both paths, and what each pod sees is unchanged
    node.plugin_pod("dp-late")
    node.claim_pod("dra-late")
    assert f"Insufficient {GPU}" in node.pending_reason("dp-late")
    assert "cannot allocate all claims" in node.pending_reason("dra-late")
    assert node.assert_never_shared() == before
    # freed across the paths again: a plugin pod's GPU to the claim, a claim's to the plugin pod
    free_across(node, "dp-late", "dp-1", "dra-late", "dra-1", "dp-later")
    for name in list(node.created):
        node.delete(name)
    until(lambda: len(node.published()) == 8, 60, "every GPU back in the slices")
    node.await_allocatable(8, 60, "every GPU back in the kubelet's count")
    until(lambda: not [b for b in node.ledger() if b.startswith(("device-plugin:", "dra-claim:"))], 60,
          "the ledger free of both paths' bookings")


def test_a_claim_allocated_on_the_gpu_the_plugin_just_booked_gets_its_pod_evicted_and_replaced(node: Node) -> None:
    """The race made deterministic: a claim for 7 GPUs leaves one free; the driver is stopped (SIGSTOP), so its
    slice still offers that GPU when a device-plugin pod takes it (Allocate books it) and a Deployment's claim
    is allocated on it (the only free GPU the scheduler sees). The driver resumed, the claim's prepare is
    refused; the GPU stays in the slice tainted `held-by-device-plugin` NoExecute, kube-controller-manager
    evicts the claim's pod, and the Deployment's next pod runs on another GPU; nothing stays in
    ContainerCreating, and the GPU then leaves the slice. Fails on the driver before, which left the held GPU
    out of its slice: the claim's pod waited in ContainerCreating until the plugin's pod was gone."""
    assert node.driver is not None
    until(lambda: len(node.published()) == 8, 60, "every GPU in the slices")
    node.await_allocatable(8, 60, "every GPU in the kubelet's count")
    node.created.append("filler")
    node.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "filler"},
         "spec": {"spec": {"devices": {"requests": [
             {"name": "gpu", "exactly": {"deviceClassName": CLASS, "count": 7}}]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "filler", "labels": {"test": "both"}},
         "spec": {"terminationGracePeriodSeconds": 1,
                  "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "filler"}],
                  "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                  "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}})
    node.running("filler")
    node.await_allocatable(1, 60, "the filler's 7 GPUs out of the kubelet's count")
    log_start = node.log.stat().st_size
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "race"},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": CLASS, "count": 1}}]}}}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "race"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "race"}},
                           "template": {"metadata": {"labels": {"app": "race", "test": "both"}}, "spec": {
                               "terminationGracePeriodSeconds": 1,
                               "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "race"}],
                               "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                               "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}}}}

    def race_pods() -> list[dict[str, Any]]:
        return list(node.json("pods", "-l", "app=race")["items"])

    def claim_device(pod: dict[str, Any]) -> str | None:
        statuses = pod["status"].get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        claim = node.json("resourceclaim", statuses[0]["resourceClaimName"])
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        return str(results[0]["device"]) if results else None

    stopped = node.driver
    stopped.send_signal(signal.SIGSTOP)
    try:
        node.plugin_pod("dp-race")  # Allocate books the last GPU; the stopped driver's slice still offers it
        node.running("dp-race")
        node.apply(template, deployment)
        first = until(lambda: next((p for p in race_pods() if claim_device(p)), None), 60,
                      "the Deployment's claim allocated")
        contested = claim_device(first)
    finally:
        stopped.send_signal(signal.SIGCONT)
    start = time.monotonic()
    try:
        node.delete("filler")  # room elsewhere for the replacement

        def replaced() -> dict[str, Any] | None:
            pods = race_pods()
            up = [p for p in pods if p["metadata"]["uid"] != first["metadata"]["uid"]
                  and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
            return up[0] if up and all(p["metadata"]["uid"] != first["metadata"]["uid"] for p in pods) else None

        try:
            second = until(replaced, 120, "the evicted pod gone and its replacement Running", every=0.5)
        except AssertionError as err:
            raise AssertionError(f"{err}; {node.diagnosis()}") from None
        record("contested_claim_pod_replaced_s", round(time.monotonic() - start, 2))
        node.logged_since(log_start, f"{contested} stays in the slice tainted {DRIVER}/held-by-device-plugin", 10)
        assert claim_device(second) != contested
        seen = node.assert_never_shared()  # dp-race and the replacement: one GPU each, not the same, none stuck
        assert seen[second["metadata"]["name"]] != seen["dp-race"]
        # no claim points at the plugin's GPU any more: it leaves the slice, as any the plugin holds
        until(lambda: contested not in node.published(), 60, f"{contested} out of the slice")
    finally:
        node.kubectl("delete", "deployment", "race", "--ignore-not-found", "--wait=true", timeout=120)
        node.kubectl("delete", "resourceclaimtemplate", "race", "--ignore-not-found", timeout=60)
        for name in [n for n in ("filler", "dp-race") if n in node.created]:
            node.delete(name)
    until(lambda: len(node.published()) == 8, 60, "every GPU back in the slices")
    node.await_allocatable(8, 60, "every GPU back in the kubelet's count")
