"""From the previous release to this tree and back, as an admin does it, on the real one-node cluster
(../shared/kube/cluster-up.sh, containerd 2.3.4: `CONTAINERD=v2`, which applies the claims' CDI specs).

v0.1.0's chart and its image (built from the release's `git archive` by its own tools/mkimage.py, on the Debian
tree `make image` keeps cached in build/image) are installed with `helm install`, and a pod asking
`nvidia.com/gpu: 1` (the device plugin's, or a DRA claim's through the DeviceClass's extendedResourceName:
the scheduler picks) and a DRA claim's pod start on them. `helm upgrade` to this tree's chart and image; then
`helm rollback` to revision 1. After each: the pods started before run on in the same containers (same
container IDs, no restart) with the same devices; a new pod of each kind gets a GPU no other pod holds; the
ledger books each pod's GPU, and none twice. Figures go to build/upgrade-figures.json.

A missing prerequisite fails, never skips; the cluster is always taken down (`cluster-down.sh --purge`) and
the fake host removed. Run with the cluster lock held, as every live cluster test:
`flock /tmp/devinject-kube.lock .venv/bin/pytest -q tests/e2e/test_upgrade_live.py`."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import devinject
from tests.e2e.conftest import REPO
from tests.e2e.kube import KUBE, need, until
from tests.e2e.test_cluster_live import (  # noqa: F401 - `image`: the imported fixture
    CHART,
    CHART_VALUES,
    KUBE_DIR,
    NAMESPACE,
    STATE,
    TEST_ROOT,
    Cluster,
    HelmConfig,
    build_fake_host,
    claim_pod,
    claimed_gpu,
    ctr_v2,
    deployment_manifest,
    devices_seen,
    foreign_kubernetes,
    image,
    nodes_of,
    run,
    running_pod,
)
from tests.previous_release import RELEASE, RELEASE_VERSION, commit_time, extract

pytestmark = pytest.mark.live

RELEASE_IMAGE = REPO / "build" / f"devinject-image-{RELEASE_VERSION}.tar"
FIGURES = REPO / "build" / "upgrade-figures.json"
figures: dict[str, float] = {}


def record(name: str, seconds: float) -> None:
    figures[name] = round(seconds, 2)
    FIGURES.parent.mkdir(exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


class Helm(HelmConfig):
    def rollback(self, name: str, **kwargs: Any) -> Any:
        return self._call("rollback", name, **kwargs)


@pytest.fixture(scope="module")
def release_chart(tmp_path_factory: pytest.TempPathFactory, image: Path) -> Path:  # noqa: F811
    """v0.1.0's chart; its image built at RELEASE_IMAGE by its own mkimage.py from its tree (the Debian tree
    shared with this tree's build: the same packages)."""
    tree = extract(tmp_path_factory.mktemp("release"), "pyproject.toml", "README.md", "src", "tools", "deploy")
    started = time.monotonic()
    built = run([sys.executable, str(tree / "tools" / "mkimage.py"), "--output", str(RELEASE_IMAGE),
                 "--work", str(REPO / "build" / "image")], 1800,
                env={**os.environ, "SOURCE_DATE_EPOCH": str(commit_time())})
    assert built.returncode == 0, f"{RELEASE}'s mkimage.py failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}"
    record("release_image_build_s", time.monotonic() - started)
    return tree / "deploy" / "helm" / "devinject"


@pytest.fixture(scope="module")
def cluster(release_chart: Path, image: Path) -> Iterator[Cluster]:  # noqa: F811
    """The cluster on containerd 2.3.4 with both images imported; taken down however the tests end."""
    need(os.geteuid() == 0, "needs root (cluster-up.sh, mknod, ctr)")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh (set DEVINJECT_KUBE to ../shared/kube)")
    made = Cluster("v2")
    # another test's short-lived stand-in (a process named containerd for 30 s) is waited out
    deadline = time.monotonic() + 90
    while (others := foreign_kubernetes()) and time.monotonic() < deadline:
        time.sleep(2)
    need(not others, f"the node to itself, but another Kubernetes runs here: {'; '.join(others)}")
    try:
        # always purged first: another run's cluster of this KUBE_DIR, stopped without --purge, kept its etcd
        # (a Helm release named devinject in it: `cannot reuse a name that is still in use`)
        run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        made.gpus = build_fake_host()
        up = run([str(KUBE / "cluster-up.sh")], 900, env=made.env)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        for archive in (RELEASE_IMAGE, image):
            ctr_v2("images", "import", str(archive))
        made.node = made.json("nodes")["items"][0]["metadata"]["name"]
        made.kubectl("label", "node", made.node, "devinject.io/accelerators=true", "--overwrite")
        yield made
    finally:
        made.kubectl("delete", "deployments,pods,resourceclaimtemplates", "-n", "default", "--all", "--wait=false",
                     check=False)
        if made.node:
            try:
                helm(made).uninstall("devinject", wait="watcher", timeout=120)
            except AssertionError as err:  # never installed, or failed: the purge below removes it all
                print(f"helm uninstall: {err}")
        down = run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        shutil.rmtree(TEST_ROOT, ignore_errors=True)
        assert down.returncode == 0, f"cluster-down.sh --purge failed:\n{down.stdout[-2000:]}{down.stderr[-2000:]}"


def helm(cluster: Cluster) -> Helm:
    return Helm(str(KUBE_DIR / "admin.kubeconfig"))


def agent_images(cluster: Cluster) -> dict[str, set[str]]:
    """Each DaemonSet's Ready pods' images (none while one rolls)."""
    out: dict[str, set[str]] = {}
    for pod in cluster.json("pods", "-n", NAMESPACE)["items"]:
        ready = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}.get("Ready") == "True"
        if ready and not pod["metadata"].get("deletionTimestamp"):
            owner = pod["metadata"]["ownerReferences"][0]["name"]
            out.setdefault(owner, set()).update(c["image"] for c in pod["spec"]["containers"])
    return out


def agents_on(cluster: Cluster, version: str) -> bool:
    wanted = {f"localhost/devinject:{version}"}
    images = agent_images(cluster)
    return sorted(images) == ["devinject", "devinject-dra"] and all(i == wanted for i in images.values())


class Pods:
    """The GPU pods started so far, on either path, and what each was given: what must stay as it is."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.gpus: dict[str, list[str]] = {}  # pod name -> the PCI addresses of its GPUs
        self.containers: dict[str, tuple[str, int]] = {}  # pod name -> its container's ID and restarts
        self.seen: dict[str, dict[str, tuple[int, int]]] = {}  # pod name -> its /dev/nvidiaN in the container

    def _container(self, pod: dict[str, Any]) -> tuple[str, int]:
        (status,) = pod["status"]["containerStatuses"]
        return status["containerID"], status["restartCount"]

    def plugin_pod(self, name: str) -> None:
        self.cluster.apply(deployment_manifest(name, 1))
        pod = running_pod(self.cluster, name)
        # the GPUs the pod's container has (the kubelet's device checkpoint lagged by over a minute here)
        seen = devices_seen(self.cluster, pod["metadata"]["name"])
        self.gpus[name] = sorted(pci for pci, (path, *_) in self.cluster.gpus.items() if path in seen)
        assert len(self.gpus[name]) == 1, (name, seen)
        self.containers[name] = self._container(pod)
        # booked in the node's ledger before a claim comes, by whichever path served it: the chart's DeviceClass
        # names nvidia.com/gpu as its extendedResourceName, so the scheduler may give an nvidia.com/gpu request
        # a DRA claim of the driver's as well as the device plugin's GPU (a device plugin's leaves the slice)
        until(lambda: set(self.nodes(name)) <= set(booked_nodes()), 60, f"{name}'s GPU booked in the ledger")
        self.check(name)

    def nodes(self, name: str) -> list[str]:
        return [f"c {self.cluster.gpus[pci][1]}:{self.cluster.gpus[pci][2]}" for pci in self.gpus[name]]

    def claim_pod(self, name: str) -> None:
        self.cluster.apply(*claim_pod(name))
        pod = running_pod(self.cluster, name)
        self.gpus[name] = [claimed_gpu(self.cluster, name)]
        self.containers[name] = self._container(pod)
        self.check(name)

    def check(self, name: str) -> None:
        seen = devices_seen(self.cluster, self.current(name)["metadata"]["name"])
        assert seen == nodes_of(self.cluster, self.gpus[name]), (name, seen, self.gpus[name])
        self.seen[name] = seen

    def current(self, name: str) -> dict[str, Any]:
        pods = [p for p in self.cluster.pods("default", f"app={name}") if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, (name, [p["metadata"]["name"] for p in pods])
        return pods[0]

    def undisturbed(self) -> None:
        """Every pod started so far: Running in the same container, never restarted, with the same devices;
        no GPU given to two of them, and none booked twice in the ledger."""
        for name in self.gpus:
            pod = self.current(name)
            assert pod["status"]["phase"] == "Running", (name, pod["status"])
            assert self._container(pod) == self.containers[name], (name, self._container(pod), self.containers[name])
            assert devices_seen(self.cluster, pod["metadata"]["name"]) == self.seen[name], name
        held = [gpu for gpus in self.gpus.values() for gpu in gpus]
        assert len(held) == len(set(held)), self.gpus
        booked = booked_nodes()
        assert len(booked) == len(set(booked)), booked  # the claims' and the device plugin's bookings
        assert sorted(booked) == sorted(n for name in self.gpus for n in self.nodes(name)), (booked, self.gpus)


def booked_nodes() -> list[str]:
    """The device nodes the ledger books for a pod (a claim's or the device plugin's), each as often as booked."""
    ledger = json.loads((STATE / "ledger.json").read_text())["allocations"] if (STATE / "ledger.json").exists() else {}
    return [node for entry in ledger.values() if entry.get("pods") for node in entry["exclusive"]]


@pytest.fixture(scope="module")
def pods(cluster: Cluster) -> Pods:
    return Pods(cluster)


def test_the_previous_release_installs_and_runs_pods_on_both_paths(cluster: Cluster, release_chart: Path,
                                                                    pods: Pods) -> None:
    started = time.monotonic()
    release = helm(cluster).install(str(release_chart), "devinject", CHART_VALUES, create_namespace=True,
                                    wait="watcher", timeout=300)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
    until(lambda: agents_on(cluster, RELEASE_VERSION), 120, f"both agents Ready on {RELEASE}'s image")
    record("release_install_s", time.monotonic() - started)
    pods.plugin_pod("plugin-before")
    pods.claim_pod("claim-before")
    pods.undisturbed()


def test_helm_upgrade_to_this_tree_keeps_the_pods_and_serves_new_ones(cluster: Cluster, pods: Pods) -> None:
    started = time.monotonic()
    release = helm(cluster).upgrade(str(CHART), "devinject", CHART_VALUES, wait="watcher", timeout=300)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
    until(lambda: agents_on(cluster, devinject.__version__), 120, "both agents Ready on this tree's image")
    record("helm_upgrade_s", time.monotonic() - started)
    pods.undisturbed()
    pods.plugin_pod("plugin-upgraded")
    pods.claim_pod("claim-upgraded")
    pods.undisturbed()


def test_helm_rollback_to_the_previous_release_keeps_the_pods_and_serves_new_ones(cluster: Cluster,
                                                                                 pods: Pods) -> None:
    started = time.monotonic()
    helm(cluster).rollback("devinject", version=1, wait="watcher", timeout=300)
    until(lambda: agents_on(cluster, RELEASE_VERSION), 120, f"both agents Ready on {RELEASE}'s image again")
    record("helm_rollback_s", time.monotonic() - started)
    pods.undisturbed()
    pods.plugin_pod("plugin-rolled-back")
    pods.claim_pod("claim-rolled-back")
    pods.undisturbed()
