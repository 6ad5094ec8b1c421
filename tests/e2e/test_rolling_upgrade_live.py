"""`helm upgrade` to a new image tag with GPU pods running, on the real one-node cluster with containerd 2.3.4
(../shared/kube/cluster-up.sh with CONTAINERD=v2): the chart's two DaemonSets, the DRA driver in its pod (issue
38: no test had run it in a pod on containerd 2), roll with the chart's default maxSurge 1, maxUnavailable 0.

Device-plugin pods and claims' pods started before the roll keep running with the same devices (same pod,
same container, no restart, the same GPU node in the container); a claim's pod and a device-plugin pod created
during the roll reach Running; never a GPU in two running pods; each agent's old pod leaves only its own
sockets' absence behind. A prober dials the DRA driver's registration sockets every PROBE_EVERY s through the
roll (GetInfo on each, then its DRA service's endpoint): the longest stretch in which no registered driver
answered is "the longest time during the roll in which a new claim could not be prepared" (goal 0 s), printed
and written to build/rolling-upgrade-figures.json.

Run alone under the cluster lock: `flock /tmp/devinject-kube.lock .venv/bin/pytest -q
tests/e2e/test_rolling_upgrade_live.py`. A missing prerequisite fails, never skips. The cluster is always
taken down (`cluster-down.sh --purge`)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.e2e.conftest import REPO
from tests.e2e.kube import KUBE, need, until
from tests.e2e.test_cluster_live import (
    BUSYBOX,
    CHART,
    CHART_VALUES,
    DRA_DRIVER,
    GPU,
    KUBE_DIR,
    NAMESPACE,
    SLEEPER,
    TEST_ROOT,
    Cluster,
    HelmConfig,
    build_fake_host,
    claimed_gpu,
    ctr_v2,
    deployment_manifest,
    devices_seen,
    foreign_kubernetes,
    image,  # noqa: F401 - the module fixture: `make image`
    nodes_of,
    published_gpus,
    run,
    running_pod,
)

pytestmark = pytest.mark.live

FIGURES = REPO / "build" / "rolling-upgrade-figures.json"
REGISTRY = Path("/var/lib/kubelet/plugins_registry")
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
ROLL_TAG = "roll"
# containerd 2 applies CDI: the device plugin answers with CDI names alone, so the container sees only what
# CDI gave it (as tests/e2e/test_both_paths_live.py runs it)
VALUES: dict[str, Any] = {**CHART_VALUES, "devicePlugin": {"config": {"allocate": "cdi"}}}
PROBE_EVERY = 0.05
PROBE_DEADLINE = 1.0  # seconds for one socket's answer (a loaded 2-core VM)


def claim_pod(name: str) -> list[dict[str, Any]]:
    """test_cluster_live's one-GPU claim's pod and template, labelled as this module's."""
    from tests.e2e.test_cluster_live import claim_pod as chart_claim_pod

    docs = chart_claim_pod(name)
    docs[1]["metadata"]["labels"]["test"] = "roll"
    return docs


def plugin_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default",
                                                            "labels": {"app": name, "test": "roll"}},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [
                {"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never", "command": SLEEPER,
                 "resources": {"limits": {GPU: 1}}}]}}


class RegistrationProber:
    """Every PROBE_EVERY s: is some DRA driver registration socket of ours answering GetInfo, with its DRA
    service's socket accepting a call? The longest stretch with none is the time a new claim could not have
    been prepared (the kubelet calls the newest registered driver; with none, it fails the prepare)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.longest_gap = 0.0
        self.most_at_once = 0  # registration sockets answering at one moment: 2 while the pods overlap
        self.seen: set[str] = set()  # every registration socket that answered
        self.rounds = 0
        self.thread = threading.Thread(target=self._run, name="prober", daemon=True)

    def answering(self) -> list[str]:
        out = []
        for path in sorted(REGISTRY.glob(f"{DRA_DRIVER}*-reg.sock")):
            try:
                with grpc.insecure_channel(f"unix://{path}") as channel:
                    stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
                    info = stub.GetInfo(reg.InfoRequest(), timeout=PROBE_DEADLINE)
                with grpc.insecure_channel(f"unix://{info.endpoint}") as service:
                    grpc.channel_ready_future(service).result(timeout=PROBE_DEADLINE)
            except (grpc.RpcError, grpc.FutureTimeoutError):
                continue
            out.append(path.name)
        return out

    def _run(self) -> None:
        gap_since: float | None = None
        while not self.stop.is_set():
            now = time.monotonic()
            up = self.answering()
            self.rounds += 1
            self.seen.update(up)
            self.most_at_once = max(self.most_at_once, len(up))
            if up:
                if gap_since is not None:
                    self.longest_gap = max(self.longest_gap, now - gap_since)
                gap_since = None
            elif gap_since is None:
                gap_since = now
            self.stop.wait(PROBE_EVERY)
        if gap_since is not None:
            self.longest_gap = max(self.longest_gap, time.monotonic() - gap_since)


class Roll(Cluster):
    def __init__(self) -> None:
        super().__init__("v2")

    def agent_pods(self) -> dict[str, list[dict[str, Any]]]:
        """Each DaemonSet's pods, by DaemonSet."""
        out: dict[str, list[dict[str, Any]]] = {"devinject": [], "devinject-dra": []}
        for pod in self.json("pods", "-n", NAMESPACE)["items"]:
            owner = pod["metadata"].get("ownerReferences", [{}])[0].get("name")
            if owner in out:
                out[owner].append(pod)
        return out

    def workloads(self) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.json("pods", "-n", "default", "-l", "test=roll")["items"]}

    def running(self, name: str, timeout: float = 120) -> dict[str, Any]:
        def up() -> dict[str, Any] | None:
            pod = self.workloads().get(name)
            if pod is not None and pod["status"].get("phase") == "Failed":
                raise AssertionError(f"{name} failed: {pod['status'].get('reason')}: {pod['status'].get('message')}")
            ok = pod is not None and pod["status"].get("phase") == "Running" and \
                all(c.get("ready") for c in pod["status"].get("containerStatuses", []))
            return pod if ok else None

        return until(up, timeout, f"pod {name} Running", every=0.3)

    def snapshot(self) -> dict[str, tuple[str, str, int, dict[str, tuple[int, int]]]]:
        """Each running workload pod: its UID, its container's ID, restarts, and the GPU nodes it sees."""
        out = {}
        for name, pod in self.workloads().items():
            if pod["status"].get("phase") != "Running":
                continue
            (status,) = pod["status"]["containerStatuses"]
            out[name] = (pod["metadata"]["uid"], status["containerID"], status["restartCount"],
                         devices_seen(self, name))
        return out

    def warnings(self, *reasons: str) -> list[str]:
        """The default namespace's Warning events whose reason holds one of `reasons`."""
        events = self.json("events", "-n", "default")["items"]
        return [f"{e['involvedObject']['name']}: {e['reason']}: {e.get('message', '')[:300]}" for e in events
                if e.get("type") == "Warning" and any(r in e["reason"] for r in reasons)]


def device_plugin_gaps(after: float) -> list[float]:
    """From the kubelet's own log, after `after` (the epoch): each stretch from its device manager's "Device
    plugin disconnected" of the GPU resource to its next "Device plugin connected" (1.36 drops the newest
    registration of a resource when the old plugin's stream ends; the new agent registers again)."""
    def stamp(line: str) -> float:
        day, clock = line[1:5], line.split()[1]  # klog: Immdd hh:mm:ss.uuuuuu, local time
        return datetime.strptime(f"{time.localtime().tm_year}{day} {clock}", "%Y%m%d %H:%M:%S.%f").timestamp()

    gaps, since = [], None
    for line in (KUBE_DIR / "logs" / "kubelet.log").read_text(errors="replace").splitlines():
        if f'"{GPU}"' not in line or line[:1] not in "IEW" or stamp(line) < after:
            continue
        if "Device plugin disconnected" in line and since is None:
            since = stamp(line)
        elif "Device plugin connected" in line and since is not None:
            gaps.append(round(stamp(line) - since, 3))
            since = None
    return gaps


def save_figures(made: Roll) -> None:
    FIGURES.parent.mkdir(exist_ok=True)
    FIGURES.write_text(json.dumps(made.figures, indent=1, sort_keys=True) + "\n")


def keep_logs(made: Roll) -> None:
    """Every component's log and each agent pod's, for the report (cluster-down.sh --purge removes them)."""
    keep = REPO / "build" / "rolling-upgrade-logs"
    shutil.rmtree(keep, ignore_errors=True)
    containers = {"devinject": "device-plugin", "devinject-dra": "dra-driver"}
    try:
        shutil.copytree(KUBE_DIR / "logs", keep)
        for daemonset, pods in made.agent_pods().items():
            for name in (p["metadata"]["name"] for p in pods):
                text = made.kubectl("-n", NAMESPACE, "logs", name, "-c", containers[daemonset], check=False)
                (keep / f"{name}.log").write_text(text)
    except Exception as err:  # the cluster is taken down whatever happens here
        print(f"keeping the logs: {err}")


@pytest.fixture(scope="module")
def roll(image: Path) -> Iterator[Roll]:  # noqa: F811 - the imported fixture
    """The cluster on containerd 2.3.4 with the image under its tag and under ROLL_TAG, and the chart installed
    (both DaemonSets); taken down (--purge) and the fake host removed however the test ends."""
    made = Roll()
    others = foreign_kubernetes()
    need(not others, f"the node to itself, but another Kubernetes runs here: {'; '.join(others)}")
    try:
        if any((KUBE_DIR / "run").glob("*.pid")):  # left up by a run that was killed
            run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        made.gpus = build_fake_host()
        up = run([str(KUBE / "cluster-up.sh")], 900, env=made.env)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        ctr_v2("images", "import", str(image))
        version = CHART.joinpath("Chart.yaml").read_text().split('appVersion: "')[1].split('"')[0]
        # the same image under a new tag, as a registry serves it
        ctr_v2("images", "tag", "--force", f"localhost/devinject:{version}", f"localhost/devinject:{ROLL_TAG}",
               timeout=60)
        made.node = made.json("nodes")["items"][0]["metadata"]["name"]
        made.kubectl("label", "node", made.node, "devinject.io/accelerators=true", "--overwrite")
        started = time.monotonic()
        release = HelmConfig(str(KUBE_DIR / "admin.kubeconfig")).install(
            str(CHART), "devinject", VALUES, create_namespace=True, wait="watcher", timeout=240)
        assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
        made.await_allocatable(8, 120, "the chart's device plugin")
        until(lambda: len(published_gpus(made)) == 8, 60, "all 8 GPUs in the DRA driver's slice")
        made.figures["install_to_both_paths_s"] = round(time.monotonic() - started, 2)
        yield made
    finally:
        keep_logs(made)
        down = run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        shutil.rmtree(TEST_ROOT, ignore_errors=True)
        assert down.returncode == 0, f"cluster-down.sh --purge failed:\n{down.stdout[-2000:]}{down.stderr[-2000:]}"


def test_helm_upgrade_surges_both_agents_and_claims_are_prepared_throughout(roll: Roll) -> None:
    # the DRA driver runs in its pod, on containerd 2, registered under its pod's UID
    old = {name: pods[0] for name, pods in roll.agent_pods().items()}
    assert all(len(pods) == 1 for pods in roll.agent_pods().values())
    old_uids = {name: pod["metadata"]["uid"] for name, pod in old.items()}
    assert [p.name for p in REGISTRY.glob(f"{DRA_DRIVER}*-reg.sock")] == \
        [f"{DRA_DRIVER}-{old_uids['devinject-dra']}-reg.sock"]
    assert f"devinject-nvidia.com-gpu-{old_uids['devinject']}.sock" in os.listdir(DEVICE_PLUGINS)

    # pods on both paths before the roll: the device plugin's first, its GPUs out of the slice before the claims
    roll.apply(plugin_pod("dp-0"), plugin_pod("dp-1"))
    for name in ("dp-0", "dp-1"):
        roll.running(name)
    until(lambda: len(published_gpus(roll)) == 6, 60, "the device plugin's 2 GPUs out of the slice")
    roll.apply(*claim_pod("claim-0"), *claim_pod("claim-1"))
    for name in ("claim-0", "claim-1"):
        roll.running(name)
    before = roll.snapshot()
    assert sorted(before) == ["claim-0", "claim-1", "dp-0", "dp-1"], before
    assert claimed_gpu(roll, "claim-0") != claimed_gpu(roll, "claim-1")
    for name in ("claim-0", "claim-1"):
        assert before[name][3] == nodes_of(roll, [claimed_gpu(roll, name)])  # containerd 2 applied its CDI spec

    prober = RegistrationProber()
    prober.thread.start()
    upgraded: dict[str, Any] = {}

    def upgrade() -> None:
        try:
            upgraded["release"] = HelmConfig(str(KUBE_DIR / "admin.kubeconfig")).upgrade(
                str(CHART), "devinject", {**VALUES, "image": {**VALUES["image"], "tag": ROLL_TAG}},
                wait="watcher", timeout=240)
        except BaseException as err:  # said in the main thread
            upgraded["error"] = err

    started, wall = time.monotonic(), time.time()
    helm = threading.Thread(target=upgrade, name="helm-upgrade", daemon=True)
    helm.start()
    try:
        # the surge: the new DRA pod beside the old one; a claim created now is prepared by one of them
        until(lambda: len(roll.agent_pods()["devinject-dra"]) == 2, 120, "the DRA driver's surge pod")
        roll.apply(*claim_pod("during-surge"))
        # the old pods going (or gone): a claim and a device-plugin pod created now
        until(lambda: all(p["metadata"]["uid"] != old_uids[n] or p["metadata"].get("deletionTimestamp")
                          for n, pods in roll.agent_pods().items() for p in pods), 180, "the old agents going")
        # the device-plugin pod by a Deployment, as workloads are: a pod the kubelet admits in the moment it
        # is without the device plugin's registration is rejected (UnexpectedAdmissionError) and made again
        during = deployment_manifest("dp-during", 1)
        during["spec"]["template"]["metadata"]["labels"]["test"] = "roll"
        roll.apply(*claim_pod("during-handover"), during)
        helm.join(300)
        assert not helm.is_alive(), "helm upgrade did not return"
    finally:
        prober.stop.set()
        prober.thread.join(30)
    assert "error" not in upgraded, upgraded.get("error")
    assert upgraded["release"]["status"] == "deployed"
    roll.figures["helm_upgrade_to_rolled_s"] = round(time.monotonic() - started, 2)

    # the new pods alone, of the new tag; only their sockets left
    until(lambda: all(len(pods) == 1 for pods in roll.agent_pods().values()), 60, "the old agents' pods gone")
    new = roll.agent_pods()
    for name, pods in new.items():
        assert len(pods) == 1 and pods[0]["metadata"]["uid"] != old_uids[name], (name, len(pods))
        assert {c["image"] for c in pods[0]["spec"]["containers"]} == {f"localhost/devinject:{ROLL_TAG}"}
    new_uids = {name: pods[0]["metadata"]["uid"] for name, pods in new.items()}
    until(lambda: [p.name for p in REGISTRY.glob(f"{DRA_DRIVER}*-reg.sock")]
          == [f"{DRA_DRIVER}-{new_uids['devinject-dra']}-reg.sock"], 30, "the old driver's sockets gone")
    assert sorted(p.name for p in (Path("/var/lib/kubelet/plugins") / DRA_DRIVER).glob("*.sock")) == \
        [f"dra-{new_uids['devinject-dra']}.sock"]
    ours = sorted(p.name for p in DEVICE_PLUGINS.glob("devinject-*"))
    assert ours and all(new_uids["devinject"] in n for n in ours), ours

    # pods created during the roll run; the ones before it kept their containers and devices
    for name in ("during-surge", "during-handover"):
        roll.running(name)
    running_pod(roll, "dp-during")
    assert not roll.warnings("Prepare"), roll.warnings("Prepare")  # no claim's prepare failed
    rejected = [p for p in roll.workloads().values() if p["status"].get("reason") == "UnexpectedAdmissionError"]
    roll.figures["device_plugin_pods_rejected_during_roll"] = len(rejected)
    after = roll.snapshot()
    for name, (uid, container, restarts, seen) in before.items():
        assert after[name] == (uid, container, 0, seen), (name, before[name], after[name])
        assert restarts == 0
    owners: dict[tuple[int, int], str] = {}
    for name, (_, _, _, seen) in after.items():
        assert len(seen) == 1, (name, seen)  # exactly its one GPU
        for gpu in seen.values():
            assert gpu not in owners, f"GPU {gpu} in two running pods: {owners[gpu]} and {name}"
            owners[gpu] = name

    # the figure: the longest stretch in which no registered DRA driver answered
    roll.figures["longest_no_driver_s"] = round(prober.longest_gap, 3)
    roll.figures["prober_rounds"] = prober.rounds
    dropped = device_plugin_gaps(wall)
    roll.figures["longest_device_plugin_unregistered_s"] = max(dropped, default=0.0)
    save_figures(roll)
    print(f"\nlongest time during the roll in which a new claim could not be prepared: {prober.longest_gap:.3f} s "
          f"({prober.rounds} probes every {PROBE_EVERY} s; registrations answering at once at most "
          f"{prober.most_at_once}: {sorted(prober.seen)})")
    print(f"device plugin: the kubelet without its {GPU} registration {dropped} s (its device manager drops the new "
          f"one as the old plugin's stream ends; registered again); device-plugin pods rejected meanwhile: "
          f"{len(rejected)}")
    assert prober.most_at_once == 2 and len(prober.seen) == 2, (prober.most_at_once, prober.seen)  # they overlapped
    assert prober.longest_gap < 1.0, prober.longest_gap
    assert max(dropped, default=0.0) < 2.0, dropped  # the agent's stream-end look (0.25 s) and a registration
