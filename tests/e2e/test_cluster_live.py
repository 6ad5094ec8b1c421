"""devinject as an admin deploys it, on a real one-node cluster (../shared/kube/cluster-up.sh: etcd,
kube-apiserver, controller-manager, scheduler and a kubelet v1.36 registered as a node), once on containerd
1.7 with CDI on (`bundled`) and once on Debian's containerd 1.6, which ignores CDI (`debian`).

`make image` builds the agent's image, `ctr images import` puts it on the node, and `kubectl apply -k
tests/cluster/overlay` applies deploy/kubernetes/ with the node's host paths pointed at a fake host (the
HGX H100 fixture with real char nodes, at /var/lib/devinject-test/host); nothing else differs (checked
below). Then, through the API: the DaemonSet's rollout, the node's capacity and allocatable, a Deployment the
default scheduler places and whose pod gets exactly the GPUs the kubelet allocated, a pod asking for more
staying Pending with the scheduler's reason, faults in the fake host leaving allocatable and coming back,
a deleted agent pod coming back and registering again, and the agent's ServiceAccount allowed nothing.

A missing prerequisite fails, never skips. The cluster is always taken down (`cluster-down.sh --purge`)
and the fake host removed. The figures measured go to build/cluster-figures.json (`make cluster-test`
prints them)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from devinject.install.nodehook import loader_name
from tests.e2e.conftest import REPO
from tests.e2e.kube import KUBE, KubeClient, need, until
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live

KUBE_DIR = Path("/tmp/devinject-cluster-test")
TEST_ROOT = Path("/var/lib/devinject-test")  # the overlay's host paths are under it
HOST = TEST_ROOT / "host"
OVERLAY = REPO / "tests" / "cluster" / "overlay"
IMAGE_TAR = REPO / "build" / "devinject-image.tar"
FIGURES = REPO / "build" / "cluster-figures.json"
SOCKETS = {"bundled": "/run/containerd-cluster/containerd.sock", "debian": "/run/containerd/containerd.sock"}
GPU = "nvidia.com/gpu"
LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"
BUSYBOX = "localhost/busybox:1"
# busybox `sleep` as PID 1 ignores SIGTERM: a trap, so a pod goes at once
SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; sleep 3600 & wait']


def run(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          **kwargs)


V2_SOCKET = "/run/containerd-v2/containerd.sock"  # ../shared/kube/README.md, CONTAINERD=v2


def ctr_v2(*args: str, timeout: float = 300) -> None:
    """containerd 2.3.4's own ctr (Debian's `ctr` is 1.6's) on the CONTAINERD=v2 cluster's socket, in the
    kubelet's namespace (k8s.io): `images import ARCHIVE`, `images tag ...`."""
    done = run([str(KUBE_DIR / "bin" / "ctr2"), "--address", V2_SOCKET, "-n", "k8s.io", *args], timeout)
    assert done.returncode == 0, done.stderr


class Cluster(KubeClient):
    def __init__(self, mode: str) -> None:
        super().__init__(KUBE_DIR, mode)
        self.mode = mode
        self.figures: dict[str, float] = {}
        self.node = ""
        self.gpus: dict[str, tuple[str, int, int]] = {}  # PCI address -> its node: path, major, minor

    def status(self) -> dict[str, Any]:
        return self.json("node", self.node)["status"]  # type: ignore[no-any-return]

    def allocatable(self, resource: str = GPU) -> int:
        return int(self.status()["allocatable"].get(resource, 0))

    def await_allocatable(self, count: int, timeout: float, what: str) -> float:
        """Seconds until the node's allocatable GPUs, read through the API, are `count`."""
        start = time.monotonic()
        until(lambda: self.allocatable() == count, timeout, f"allocatable {GPU} {count} ({what})", every=0.1)
        return round(time.monotonic() - start, 2)

    def kubelet_counted(self, healthy: int, after: float, timeout: float = 30) -> float:
        """When (the epoch) the kubelet's device manager first counted `healthy` healthy GPUs at or after
        `after`: its own log line, at the moment the agent's ListAndWatch update reached it."""
        def stamp() -> float | None:
            for line in (KUBE_DIR / "logs" / "kubelet.log").read_text(errors="replace").splitlines():
                if "Processed device updates" in line and f'resourceName="{GPU}"' in line \
                        and line.endswith(f"healthyCount={healthy}"):
                    day, clock = line[1:5], line.split()[1]  # klog: Immdd hh:mm:ss.uuuuuu, local time
                    at = datetime.strptime(f"{time.localtime().tm_year}{day} {clock}", "%Y%m%d %H:%M:%S.%f")
                    if at.timestamp() >= after:
                        return at.timestamp()
            return None

        return until(stamp, timeout, f"the kubelet to count {healthy} healthy {GPU}", every=0.5)

    def exec(self, pod: str, script: str, namespace: str = "default", container: str | None = None) -> str:
        return self.kubectl("-n", namespace, "exec", pod, *(["-c", container] if container else []), "--",
                            "sh", "-c", script)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.json("pods", "-n", namespace, "-l", selector)["items"]  # type: ignore[no-any-return]

    def agent(self) -> dict[str, Any] | None:
        """The agent's pod when it is Ready."""
        for pod in self.pods("devinject-system", "app.kubernetes.io/name=devinject"):
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            if conditions.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp"):
                return pod
        return None

    def logged(self, text: str, after: float, timeout: float) -> float:
        """When (the epoch, the runtime's own stamp) the Ready agent first logged a line holding `text` at or
        after `after`."""
        def stamp() -> float | None:
            agent = self.agent()
            log = "" if agent is None else self.kubectl("-n", "devinject-system", "logs", "--timestamps",
                                                        agent["metadata"]["name"], "-c", "device-plugin", check=False)
            for line in log.splitlines():
                when, _, said = line.partition(" ")
                if text in said and (at := datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()) >= after:
                    return at
            return None

        return until(stamp, timeout, f"the agent to log {text!r}", every=0.5)

    def allocated(self, pod_uid: str) -> list[str]:
        """The GPU device IDs the kubelet allocated to a pod (its device manager's checkpoint)."""
        checkpoint = json.loads(Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").read_text())
        ids: list[str] = []
        for entry in checkpoint["Data"]["PodDeviceEntries"]:
            if entry["PodUID"] == pod_uid and entry["ResourceName"] == GPU:
                by_numa = entry["DeviceIDs"]
                ids += [i for group in by_numa.values() for i in group] if isinstance(by_numa, dict) else by_numa
        return sorted(ids)


def build_fake_host() -> dict[str, tuple[str, int, int]]:
    """The HGX H100 fixture with real char nodes at HOST, and an empty kernel log there for the agent to
    follow; each GPU's node (path, major, minor: the driver's procfs and the node itself), by PCI address."""
    shutil.rmtree(TEST_ROOT, ignore_errors=True)
    builder = LibBuilder()
    try:
        build_hgx_h100(builder, FakeHost(HOST, real_nodes=True))
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    (HOST / "var" / "log").mkdir(parents=True)
    (HOST / "var" / "log" / "kern.log").write_text("")
    for directory in (TEST_ROOT, HOST):
        directory.chmod(0o755)  # the node hook is refused under a directory others could write
    gpus = {}
    for info in sorted((HOST / "proc" / "driver" / "nvidia" / "gpus").glob("*/information")):
        minor = next(line.split()[-1] for line in info.read_text().splitlines() if line.startswith("Device Minor:"))
        rdev = os.stat(HOST / "dev" / f"nvidia{minor}").st_rdev
        gpus[info.parent.name] = (f"/dev/nvidia{minor}", os.major(rdev), os.minor(rdev))
    assert len(gpus) == 8, gpus
    return gpus


def foreign_kubernetes() -> list[str]:
    """Kubernetes processes not of this test's cluster (another run's kube-up.sh or cluster-up.sh): they
    share /var/lib/kubelet and the kubelet's ports with it, and one's --purge wipes the other's state. A
    bundled containerd's shim left by another cluster counts too: cluster-down.sh refuses to purge while
    it runs."""
    found = []
    for exe in Path("/proc").glob("[0-9]*/exe"):
        try:
            path = os.readlink(exe)
        except OSError:
            continue
        if path.startswith((f"{KUBE_DIR}/", "/usr/")):  # ours, or Debian's containerd and its shims
            continue
        if Path(path).name in ("kubelet", "kube-apiserver", "containerd", "containerd-shim-runc-v2"):
            found.append(f"pid {exe.parent.name} {path}")
    return found


def record(cluster: Cluster, name: str, seconds: float) -> None:
    cluster.figures[name] = seconds
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    figures.setdefault(cluster.mode, {})[name] = seconds
    FIGURES.parent.mkdir(exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def image() -> Path:
    """`make image`: the agent's image as the README builds it (a no-op when it is current)."""
    need(os.geteuid() == 0, "needs root (cluster-up.sh, mknod, ctr)")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh (set DEVINJECT_KUBE to ../shared/kube)")
    need(shutil.which("make") and shutil.which("mmdebstrap"), "make and mmdebstrap (make system-deps)")
    built = run(["make", "-C", str(REPO), "image"], 1800)
    assert built.returncode == 0, f"make image failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}"
    need(IMAGE_TAR.exists(), f"make image wrote no {IMAGE_TAR}")
    FIGURES.unlink(missing_ok=True)  # this run's figures alone
    return IMAGE_TAR


@pytest.fixture(scope="module", params=["bundled", "debian"])
def cluster(request: pytest.FixtureRequest, image: Path) -> Iterator[Cluster]:
    """The cluster on one containerd, the agent rolled out on its node; taken down (--purge: the README
    wants it before switching containerd) and the fake host removed, however the tests end."""
    made = Cluster(request.param)
    # before anything is torn down: a --purge would wipe the other cluster's kubelet and containerd state
    others = foreign_kubernetes()
    need(not others, f"the node to itself, but another Kubernetes runs here: {'; '.join(others)}")
    try:
        if any((KUBE_DIR / "run").glob("*.pid")):  # left up by a run that was killed: maybe the other containerd
            run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        made.gpus = build_fake_host()
        up = run([str(KUBE / "cluster-up.sh")], 900, env=made.env)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        need(shutil.which("ctr"), "ctr (containerd's client; cluster-up.sh installs containerd)")
        imported = run(["ctr", "--address", SOCKETS[made.mode], "-n", "k8s.io", "images", "import", str(image)], 300)
        assert imported.returncode == 0, imported.stderr
        nodes = made.json("nodes")["items"]
        assert len(nodes) == 1, [n["metadata"]["name"] for n in nodes]
        made.node = nodes[0]["metadata"]["name"]
        made.kubectl("label", "node", made.node, "devinject.io/accelerators=true", "--overwrite")
        start = time.monotonic()
        made.kubectl("apply", "-k", str(OVERLAY))
        made.kubectl("-n", "devinject-system", "rollout", "status", "daemonset/devinject", "--timeout=300s",
                     timeout=320)
        record(made, "rollout_s", round(time.monotonic() - start, 2))
        record(made, "apply_to_allocatable_s", round(made.await_allocatable(8, 120, "the agent's registration")
                                                  + made.figures["rollout_s"], 2))
        yield made
    finally:
        down = run([str(KUBE / "cluster-down.sh"), "--purge"], 600, env=made.env)
        shutil.rmtree(TEST_ROOT, ignore_errors=True)
        assert down.returncode == 0, f"cluster-down.sh --purge failed:\n{down.stdout[-2000:]}{down.stderr[-2000:]}"


def deployment_manifest(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}},
                              "spec": {"terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                                                       "command": SLEEPER,
                                                       "resources": {"limits": {GPU: gpus}}}]}}}}


def running_pod(cluster: Cluster, app: str, timeout: float = 120) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        for pod in cluster.pods("default", f"app={app}"):
            if pod["status"].get("phase") == "Running" and pod["status"].get("podIP") is not None \
                    and all(c.get("ready") for c in pod["status"].get("containerStatuses", [])):
                return pod
        return None

    return until(ready, timeout, f"a Running pod of {app}")


@pytest.fixture(scope="module")
def deployment(cluster: Cluster) -> Iterator[dict[str, Any]]:
    """A Deployment asking for 2 GPUs, its pod Running: it keeps running through the tests below."""
    cluster.apply(deployment_manifest("gpu-two", 2))
    yield running_pod(cluster, "gpu-two")
    cluster.kubectl("delete", "deployment", "gpu-two", "--wait=false", check=False)


def devices_seen(cluster: Cluster, pod: str) -> dict[str, tuple[int, int]]:
    """The pod's GPU nodes (/dev/nvidiaN): major and minor, as the container sees them."""
    out = cluster.exec(pod, 'for f in /dev/nvidia[0-9]*; do [ -e "$f" ] && stat -c "%n %t %T" "$f"; done; true')
    return {name: (int(major, 16), int(minor, 16)) for name, major, minor in (line.split() for line in
                                                                               out.splitlines())}


def nodes_of(cluster: Cluster, pcis: list[str]) -> dict[str, tuple[int, int]]:
    return {cluster.gpus[pci][0]: cluster.gpus[pci][1:] for pci in pcis}


def test_the_overlay_differs_from_the_shipped_manifests_only_in_host_paths(cluster: Cluster) -> None:
    shipped = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(REPO / "deploy" / "kubernetes"))))
    tested = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(OVERLAY))))
    assert [d["kind"] for d in shipped] == [d["kind"] for d in tested]
    changed = []
    for base, ours in zip(shipped, tested, strict=True):
        if base["kind"] != "DaemonSet":
            assert ours == base
            continue
        spec, base_spec = ours["spec"]["template"]["spec"], base["spec"]["template"]["spec"]
        base_volumes = {v["name"]: v for v in base_spec["volumes"]}
        assert sorted(base_volumes) == sorted(v["name"] for v in spec["volumes"])
        spec["volumes"].sort(key=lambda v: v["name"])
        base_spec["volumes"].sort(key=lambda v: v["name"])
        for volume in spec["volumes"]:
            base_volume = base_volumes[volume["name"]]
            if volume.get("hostPath") != base_volume.get("hostPath"):
                assert volume["hostPath"]["path"].startswith(f"{TEST_ROOT}/"), volume
                changed.append(volume["name"])
                volume["hostPath"] = base_volume["hostPath"]
        for container in spec["initContainers"] + spec["containers"]:
            assert container.pop("imagePullPolicy") == "Never"
        for container in base_spec["initContainers"] + base_spec["containers"]:
            assert container.pop("imagePullPolicy") == "IfNotPresent"
        args = spec["containers"][0]["args"]
        args[args.index(f"--target-root={HOST}")] = "--target-root=/"
        assert ours == base
    # the kubelet's device-plugins directory and /var/run/cdi stay the node's own
    assert sorted(changed) == ["dev", "host-root", "node-hook", "proc", "state", "sys"]


def test_the_daemonset_rolls_out_and_the_node_shows_the_gpus_and_nics(cluster: Cluster) -> None:
    status = cluster.status()
    for field in ("capacity", "allocatable"):
        assert status[field].get(GPU) == "8", status[field]
        assert status[field].get("nvidia.com/rdma") == "8", status[field]
    agent = cluster.agent()
    assert agent is not None
    (init,) = agent["status"]["initContainerStatuses"]
    assert init["state"]["terminated"]["exitCode"] == 0, init
    # the init container installed the node hook, and the specs name it (under the fake host's root)
    bundle = HOST / "opt" / "devinject" / "hook"
    assert (bundle / "bin" / "devinject").is_file()
    spec = yaml.safe_load(Path("/var/run/cdi/nvidia.com-gpu.yaml").read_text())
    # what the bundle's launcher runs, named directly (no /bin/sh): its loader, in the launcher's environment
    assert {(h["path"], h["env"][0]) for h in spec["containerEdits"]["hooks"]} == {
        (str(bundle / "lib" / loader_name()), f"PYTHONHOME={bundle}")}
    assert cluster.figures["rollout_s"] < 300


def test_the_scheduler_places_a_deployment_and_its_pod_gets_the_gpus_the_kubelet_allocated(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    name, uid = deployment["metadata"]["name"], deployment["metadata"]["uid"]
    assert deployment["spec"]["nodeName"] == cluster.node
    events = cluster.json("events", "-n", "default", "--field-selector",
                          f"involvedObject.name={name},reason=Scheduled")["items"]
    assert [e.get("reportingComponent") or e["source"].get("component") for e in events] == ["default-scheduler"]
    allocated = cluster.allocated(uid)
    assert len(allocated) == 2, allocated
    assert devices_seen(cluster, name) == nodes_of(cluster, allocated)  # those two and no other GPU
    # the driver's files are there, read-only
    mounts = cluster.exec(name, f"grep ' {LIBCUDA} ' /proc/mounts; touch {LIBCUDA} 2>&1; true")
    assert " ro," in mounts and "Read-only file system" in mounts, mounts
    assert cluster.exec(name, "cat /dev/nvidiactl 2>&1; true").strip().endswith("No such device or address")
    ldcache = cluster.exec(name, "grep -c libcuda.so.1 /etc/ld.so.cache 2>&1; true").strip()
    if cluster.mode == "bundled":
        # the linker cache only the spec's update-ldcache hook makes (busybox's image has none): CDI applied
        # the spec, and its hook ran from the node hook bundle the init container installed
        assert ldcache == "1", ldcache
    else:
        # containerd 1.6 drops the CDI names: what the pod got is Allocate's fallback, which runs no hook
        assert "No such file" in ldcache, ldcache


def test_a_pod_asking_for_more_than_is_free_stays_pending_with_the_schedulers_reason(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    free = cluster.allocatable() - 2
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-many", "namespace": "default"},
                   "spec": {"terminationGracePeriodSeconds": 1,
                            "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                                            "command": SLEEPER, "resources": {"limits": {GPU: free + 1}}}]}})
    try:
        def unschedulable() -> dict[str, Any] | None:
            pod = cluster.json("pod", "-n", "default", "too-many")
            for condition in pod["status"].get("conditions", []):
                if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
                    return {**condition, "phase": pod["status"].get("phase"), "node": pod["spec"].get("nodeName")}
            return None

        condition = until(unschedulable, 60, "the scheduler to refuse the pod")
        assert f"Insufficient {GPU}" in condition["message"], condition
        assert condition["phase"] == "Pending" and condition["node"] is None, condition
    finally:
        cluster.kubectl("delete", "pod", "-n", "default", "too-many", "--wait=false", check=False)


def free_gpu(cluster: Cluster, deployment: dict[str, Any]) -> str:
    return sorted(set(cluster.gpus) - set(cluster.allocated(deployment["metadata"]["uid"])))[-1]


def assert_still_running(cluster: Cluster, deployment: dict[str, Any]) -> None:
    pod = cluster.json("pod", "-n", "default", deployment["metadata"]["name"])
    assert pod["metadata"]["uid"] == deployment["metadata"]["uid"]
    assert pod["status"]["phase"] == "Running"
    assert [c["restartCount"] for c in pod["status"]["containerStatuses"]] == [0]
    allocated = cluster.allocated(pod["metadata"]["uid"])
    assert devices_seen(cluster, pod["metadata"]["name"]) == nodes_of(cluster, allocated)


def serves_again(cluster: Cluster, deployment: dict[str, Any], started: float, figure: str, what: str, app: str,
                 check_devices: bool) -> None:
    """After the agent pod was replaced (at `started`): it registers again (timed as `figure`), counts all 8
    GPUs, the running pod keeps its own, and a new one-GPU pod `app` gets one no other pod holds (and sees
    exactly its nodes, `check_devices`)."""
    registered = cluster.logged(f"{GPU}: registered with the kubelet", started, 60)
    record(cluster, figure, round(registered - started, 2))
    cluster.await_allocatable(8, 60, what)
    assert_still_running(cluster, deployment)
    cluster.apply(deployment_manifest(app, 1))
    try:
        pod = running_pod(cluster, app)
        mine = cluster.allocated(pod["metadata"]["uid"])
        theirs = cluster.allocated(deployment["metadata"]["uid"])
        assert len(mine) == 1 and not set(mine) & set(theirs), (mine, theirs)
        if check_devices:
            assert devices_seen(cluster, pod["metadata"]["name"]) == nodes_of(cluster, mine)
    finally:
        cluster.kubectl("delete", "deployment", app, "--wait=false", check=False)


def test_a_deleted_agent_pod_comes_back_registers_again_and_no_gpu_is_given_twice(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    old = cluster.agent()
    assert old is not None
    started = time.time()
    cluster.kubectl("-n", "devinject-system", "delete", "pod", old["metadata"]["name"], "--wait=false")
    until(lambda: (p := cluster.agent()) and p["metadata"]["uid"] != old["metadata"]["uid"] and p, 180,
                "a new agent pod, Ready")
    record(cluster, "agent_pod_deleted_to_ready_s", round(time.time() - started, 2))
    serves_again(cluster, deployment, started, "agent_pod_deleted_to_registered_s", "after the agent's restart",
                 "gpu-one", check_devices=True)


def test_a_rolling_update_to_a_new_image_tag_keeps_running_pods_and_their_gpus(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    """Day 2: the DaemonSet's image moves to a new tag (the same image here, tagged anew, as a registry
    would serve it); the agent rolls over, registers again, and the running pod keeps its devices."""
    image = cluster.json("daemonset", "-n", "devinject-system", "devinject")["spec"]["template"]["spec"]
    current = image["containers"][0]["image"]
    updated = current.rsplit(":", 1)[0] + ":rolling-update"
    tagged = run(["ctr", "--address", SOCKETS[cluster.mode], "-n", "k8s.io", "images", "tag", "--force", current,
                  updated], 60)
    assert tagged.returncode == 0, tagged.stderr
    old = cluster.agent()
    assert old is not None
    started = time.time()
    cluster.kubectl("-n", "devinject-system", "set", "image", "daemonset/devinject", f"device-plugin={updated}",
                    f"install-node-hook={updated}")
    cluster.kubectl("-n", "devinject-system", "rollout", "status", "daemonset/devinject", "--timeout=180s",
                    timeout=200)
    agent = until(lambda: (p := cluster.agent()) and p["metadata"]["uid"] != old["metadata"]["uid"] and p, 180,
                  "the updated agent pod, Ready")
    assert {c["image"] for c in agent["spec"]["containers"] + agent["spec"]["initContainers"]} == {updated}
    record(cluster, "rolling_update_to_ready_s", round(time.time() - started, 2))
    serves_again(cluster, deployment, started, "rolling_update_to_registered_s", "after the rolling update",
                 "gpu-after-update", check_devices=False)


def test_a_driver_unbind_leaves_allocatable_and_a_rebind_comes_back(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    """A fault the agent polls (the fake host sends no uevent): the GPU's sysfs `driver` link goes."""
    link = (HOST / "sys" / "bus" / "pci" / "devices" / free_gpu(cluster, deployment)).resolve() / "driver"
    target = os.readlink(link)
    started = time.time()
    link.unlink()
    try:
        record(cluster, "unbind_to_allocatable_s", cluster.await_allocatable(7, 90, "the unbind"))
        record(cluster, "unbind_to_agent_take_out_s",
               round(cluster.logged("driver unbound", started, 30) - started, 2))
        assert_still_running(cluster, deployment)
    finally:
        if not link.is_symlink():
            link.symlink_to(target)
    record(cluster, "rebind_to_allocatable_s", cluster.await_allocatable(8, 180, "the rebind"))


def test_an_xid_leaves_allocatable_at_once_and_the_admins_put_back_restores_it(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    """A fault the kernel announces: a fatal Xid line in the kernel log the agent follows."""
    pci = free_gpu(cluster, deployment)
    started = time.time()
    with (HOST / "var" / "log" / "kern.log").open("a") as log:
        log.write(f"[ 4242.424242] NVRM: Xid (PCI:{pci[:-2]}): 79, pid=0, GPU has fallen off the bus.\n")
    record(cluster, "xid_to_allocatable_s", cluster.await_allocatable(7, 60, "the Xid"))
    record(cluster, "xid_to_agent_take_out_s", round(cluster.logged("fatal Xid 79", started, 30) - started, 2))
    record(cluster, "xid_to_kubelet_s", round(cluster.kubelet_counted(7, started) - started, 2))
    assert cluster.status()["capacity"][GPU] == "8"  # unhealthy, not gone
    assert_still_running(cluster, deployment)
    agent = cluster.agent()
    assert agent is not None
    start = time.monotonic()
    cluster.exec(agent["metadata"]["name"], f"devinject put-back {GPU}={pci} --root /host --state-dir /run/devinject",
                 namespace="devinject-system", container="device-plugin")
    cluster.await_allocatable(8, 90, "the put-back")
    record(cluster, "put_back_to_allocatable_s", round(time.monotonic() - start, 2))


def test_the_agents_service_account_may_do_nothing_beyond_the_defaults(cluster: Cluster) -> None:
    def rules(account: str) -> list[str]:
        return cluster.kubectl("auth", "can-i", "--list", f"--as=system:serviceaccount:{account}").splitlines()

    ours = rules("devinject-system:devinject")
    assert ours == rules("devinject-system:nobody-at-all")  # what any authenticated account may do
    resources = {line.split()[0] for line in ours[1:] if not line.startswith(" ")}
    assert resources == {f"{kind}.authorization.k8s.io" for kind in ("selfsubjectaccessreviews",
                                                                     "selfsubjectrulesreviews")} \
        | {"selfsubjectreviews.authentication.k8s.io"}, ours
    for verb, what in (("get", "nodes"), ("list", "pods"), ("get", "secrets"), ("patch", "nodes/status")):
        answer = cluster.kubectl("auth", "can-i", verb, what, "--as=system:serviceaccount:devinject-system:devinject",
                                 check=False).strip()
        assert answer == "no", (verb, what, answer)


def test_the_allocate_answer_carries_the_cdi_names_and_the_fallback(cluster: Cluster,
                                                                    deployment: dict[str, Any]) -> None:
    """What the kubelet kept of the agent's Allocate answer (its checkpoint): the CDI names, which containerd
    1.7 applies, and the same GPUs' device nodes as the fallback, which containerd 1.6 applies."""
    from devinject.deviceplugin.api.v1beta1_pb2 import ContainerAllocateResponse

    checkpoint = json.loads(Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").read_text())
    (entry,) = [e for e in checkpoint["Data"]["PodDeviceEntries"]
                if e["PodUID"] == deployment["metadata"]["uid"] and e["ResourceName"] == GPU]
    answer = ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
    allocated = cluster.allocated(deployment["metadata"]["uid"])
    spec = yaml.safe_load(Path("/var/run/cdi/nvidia.com-gpu.yaml").read_text())
    by_name = {f"{spec['kind']}={d['name']}": d["containerEdits"]["deviceNodes"][0]["path"] for d in spec["devices"]}
    named = sorted(by_name[d.name] for d in answer.cdi_devices)
    assert named == sorted(nodes_of(cluster, allocated)), answer.cdi_devices  # those GPUs' names, no other
    gpu_nodes = {d.host_path for d in answer.devices if d.container_path.removeprefix("/dev/nvidia").isdigit()}
    assert gpu_nodes == {f"{HOST}{path}" for path in nodes_of(cluster, allocated)}


# --- the Helm chart in place of the kustomize manifests, on the same cluster and fake host: the admin's way out
# of one (`kubectl delete -k`) and in and out of the other (`helm install`, `helm uninstall`), through Helm v4's
# own engine (helm-python-sdk binds its Go SDK), both paths' GPU pods on the chart's agents.

CHART = REPO / "deploy" / "helm" / "devinject"
NAMESPACE = "devinject-system"
DRA_DRIVER = "dra.devinject.io"
STATE = TEST_ROOT / "run" / "devinject"  # the overlay's state dir, kept by the chart's release: one ledger
# what the chart's values move for this fake host, as tests/cluster/overlay does for the manifests
CHART_VALUES = {"image": {"pullPolicy": "Never"}, "hostRoot": str(HOST), "stateDir": str(STATE)}


def agent_sockets() -> list[str]:
    """Every socket of devinject's agents in the kubelet's plugin directories."""
    kubelet = Path("/var/lib/kubelet")
    found = [*(kubelet / "device-plugins").glob("devinject-*"), *(kubelet / "plugins_registry").glob(f"{DRA_DRIVER}*"),
             *(kubelet / "plugins" / DRA_DRIVER).glob("*")]
    return sorted(str(p) for p in found)


def claim_specs() -> list[str]:
    return sorted(p.name for p in Path("/var/run/cdi").glob(f"{DRA_DRIVER}-*.json"))


def slices(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.json("resourceslices", "--field-selector", f"spec.driver={DRA_DRIVER}")["items"]  # type: ignore[no-any-return]


# Helm's Go SDK runs in a child process: loaded into pytest's own, its Go runtime's threads stay for good, and
# a multi-threaded process can no longer join a mount namespace (setns: EINVAL), which the hook's tests do.
HELM_CALL = """
import json, sys
import helm_python
kubeconfig, namespace, op, args, kwargs = json.loads(sys.argv[1])
with helm_python.Config(kubeconfig_path=kubeconfig, namespace=namespace) as config:
    answer = getattr(config, op)(*args, **kwargs)
print(json.dumps(answer, default=str))
"""


class HelmConfig:
    """helm_python.Config's install, upgrade and uninstall, each in a process of its own."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig

    def __enter__(self) -> HelmConfig:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def _call(self, op: str, *args: Any, timeout: float = 300, **kwargs: Any) -> Any:
        call = [self.kubeconfig, NAMESPACE, op, list(args), {**kwargs, "timeout": timeout}]
        done = subprocess.run([sys.executable, "-c", HELM_CALL, json.dumps(call)], capture_output=True, text=True,
                              timeout=timeout + 60)
        assert done.returncode == 0, f"helm {op}: {done.stderr[-2000:]}"
        return json.loads(done.stdout.splitlines()[-1])

    def install(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("install", *args, **kwargs)

    def upgrade(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("upgrade", *args, **kwargs)

    def uninstall(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("uninstall", *args, **kwargs)


def helm_config(cluster: Cluster) -> HelmConfig:
    return HelmConfig(str(KUBE_DIR / "admin.kubeconfig"))


def devinject_objects(cluster: Cluster) -> list[str]:
    """What of devinject's own the API server still holds (DaemonSets, ConfigMaps, RBAC, classes, policy)."""
    kinds = "daemonsets,configmaps,serviceaccounts,clusterroles,clusterrolebindings,deviceclasses," \
            "validatingadmissionpolicies,validatingadmissionpolicybindings"
    items = cluster.json(kinds, "-A", "-l", "app.kubernetes.io/part-of=devinject")["items"]
    return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in items)


def test_kubectl_delete_k_removes_the_agent_and_its_sockets_and_keeps_running_pods(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    assert [s for s in agent_sockets() if "device-plugins" in s]
    cluster.kubectl("delete", "-k", str(OVERLAY), "--wait=true", "--timeout=180s", timeout=200)
    until(lambda: not cluster.json("pods", "-n", NAMESPACE)["items"], 120, "the agent's pod gone")
    assert devinject_objects(cluster) == []
    assert agent_sockets() == []  # the agent removed its own as its pod went (SIGTERM)
    assert_still_running(cluster, deployment)  # the GPUs it handed out stay with their pods


def published_gpus(cluster: Cluster) -> set[str]:
    """The PCI addresses of the GPUs in the DRA driver's slices."""
    return {pci for s in slices(cluster) for d in s["spec"].get("devices", [])
            if (pci := d["attributes"].get("resource.kubernetes.io/pciBusID", {}).get("string")) in cluster.gpus}


def claim_pod(name: str) -> list[dict[str, Any]]:
    """A pod of one GPU through a claim of the chart's class, and its claim template."""
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
             "metadata": {"name": name, "namespace": "default"},
             "spec": {"spec": {"devices": {"requests": [
                 {"name": "gpu", "exactly": {"deviceClassName": "nvidia-gpu.devinject.io", "count": 1}}]}}}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default",
                                                             "labels": {"app": name, "test": "helm"}},
             "spec": {"terminationGracePeriodSeconds": 1,
                      "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
                      "containers": [{"name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
                                      "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}}]


def claimed_gpu(cluster: Cluster, pod: str) -> str:
    """The PCI address of the GPU the claim of `pod` was allocated."""
    (claim,) = [c for c in cluster.json("resourceclaims", "-n", "default")["items"]
                if c["metadata"]["name"].startswith(f"{pod}-")]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRA_DRIVER
    by_name = {d["name"]: d["attributes"].get("resource.kubernetes.io/pciBusID", {}).get("string")
               for s in slices(cluster) if s["spec"]["pool"]["name"] == result["pool"] for d in s["spec"]["devices"]}
    return str(by_name[result["device"]])


def test_a_move_to_dra_gets_every_gpu_back_from_the_device_plugins_bookings(
        cluster: Cluster, deployment: dict[str, Any]) -> None:
    """The move in the usual order: the device plugin's DaemonSet deleted first (above), then its pods, then
    the DRA driver alone from the chart, in its pod. The device plugin's bookings of those pods are in the
    ledger with no device plugin left to release them: the driver does, and all 8 GPUs are in its slice and 8
    one-GPU claims' pods Running within 60 s, each (where the runtime applies CDI) seeing its own GPU."""
    assert cluster.allocated(deployment["metadata"]["uid"])  # the plugin's bookings, left in the ledger
    cluster.kubectl("delete", "deployment", "-n", "default", "gpu-two", "--wait=true", timeout=120)
    until(lambda: not cluster.pods("default", "app=gpu-two"), 120, "the device plugin's pods gone")
    with helm_config(cluster) as config:
        release = config.install(str(CHART), "devinject", {**CHART_VALUES, "devicePlugin": {"enabled": False}},
                                 create_namespace=True, wait="watcher", timeout=300)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
    started = time.monotonic()
    assert [d["metadata"]["name"] for d in cluster.json("daemonsets", "-n", NAMESPACE)["items"]] == ["devinject-dra"]
    names = [f"moved-{n}" for n in range(8)]
    cluster.apply(*[doc for name in names for doc in claim_pod(name)])
    until(lambda: len(published_gpus(cluster)) == 8, 60, "all 8 GPUs in the DRA driver's slice")
    record(cluster, "dra_start_to_8_gpus_in_slice_s", round(time.monotonic() - started, 2))
    for name in names:
        running_pod(cluster, name, timeout=max(1.0, 60 - (time.monotonic() - started)))
    record(cluster, "dra_start_to_8_claims_running_s", round(time.monotonic() - started, 2))
    claimed = {name: claimed_gpu(cluster, name) for name in names}
    assert sorted(claimed.values()) == sorted(cluster.gpus), claimed  # never a GPU in two pods
    if cluster.mode == "bundled":
        for name in names:
            assert devices_seen(cluster, name) == nodes_of(cluster, [claimed[name]])
    for name in names:
        cluster.kubectl("delete", "pod", "-n", "default", name, "--wait=false", timeout=60)
    until(lambda: not cluster.pods("default", "test=helm"), 120, "the claims' pods gone")
    cluster.kubectl("delete", "resourceclaimtemplates", "-n", "default", "--all", timeout=60)
    until(lambda: claim_specs() == [], 60, "the claims' specs removed (unprepared)")


def test_helm_upgrade_to_both_paths_gives_each_pod_exactly_its_devices(cluster: Cluster) -> None:
    """`helm upgrade` turns the device plugin on beside the DRA driver: a device-plugin pod and a claim's pod
    each get one GPU no other pod holds, and see exactly it (the claim's where the runtime applies CDI:
    containerd 1.6 drops the claim's CDI names, so its pod runs and sees none)."""
    started = time.monotonic()
    with helm_config(cluster) as config:
        release = config.upgrade(str(CHART), "devinject", CHART_VALUES, wait="watcher", timeout=300)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
    record(cluster, "helm_upgrade_to_ready_s", round(time.monotonic() - started, 2))
    daemonsets = {d["metadata"]["name"]: d for d in cluster.json("daemonsets", "-n", NAMESPACE)["items"]}
    assert sorted(daemonsets) == ["devinject", "devinject-dra"]
    assert all(d["status"]["numberReady"] == 1 for d in daemonsets.values()), [d["status"] for d in daemonsets.values()]
    cluster.await_allocatable(8, 120, "the chart's device plugin")

    cluster.apply(deployment_manifest("gpu-helm", 1))
    plugin_pod = running_pod(cluster, "gpu-helm")
    mine = cluster.allocated(plugin_pod["metadata"]["uid"])
    assert len(mine) == 1, mine
    assert devices_seen(cluster, plugin_pod["metadata"]["name"]) == nodes_of(cluster, mine)
    # the plugin's GPU leaves the DRA driver's slice (both paths share the node's ledger); the claim comes after,
    # so that the scheduler does not place it on that GPU before the slice says so (a race docs/lifecycle.md
    # describes, which tests/e2e/test_both_paths_live.py covers)
    until(lambda: not set(mine) & published_gpus(cluster), 30, "the plugin's GPU out of the slice")
    cluster.apply(*claim_pod("gpu-claim"))
    running_pod(cluster, "gpu-claim")
    claimed = claimed_gpu(cluster, "gpu-claim")
    assert claimed not in mine, (claimed, mine)  # never a GPU in two running pods
    (claim,) = [c for c in cluster.json("resourceclaims", "-n", "default")["items"]
                if c["metadata"]["name"].startswith("gpu-claim-")]
    assert claim_specs() == [f"{DRA_DRIVER}-{claim['metadata']['uid']}.json"]
    seen = devices_seen(cluster, "gpu-claim")
    assert seen == (nodes_of(cluster, [claimed]) if cluster.mode == "bundled" else {}), seen


def test_helm_uninstall_leaves_no_slice_daemonset_socket_or_claim_spec(cluster: Cluster) -> None:
    """Once the claims' pods are gone, `helm uninstall` leaves none of devinject's objects, slices, sockets
    or claim specs; what stays on the node is what docs/deploy.md says (the state dir, the node's specs, the
    node hook, the node's label)."""
    cluster.kubectl("delete", "pod", "-n", "default", "gpu-claim", "--wait=true", timeout=120)
    cluster.kubectl("delete", "resourceclaimtemplate", "-n", "default", "gpu-claim", timeout=60)
    cluster.kubectl("delete", "deployment", "-n", "default", "gpu-helm", "--wait=true", timeout=120)
    until(lambda: claim_specs() == [], 60, "the claim's spec removed (unprepared)")
    started = time.monotonic()
    with helm_config(cluster) as config:
        config.uninstall("devinject", wait="watcher", timeout=180)
    until(lambda: not cluster.json("pods", "-n", NAMESPACE)["items"], 120, "the agents' pods gone")
    assert devinject_objects(cluster) == []
    assert agent_sockets() == []
    # the kubelet deletes a driver's slices once its registration has been gone a while (30 s)
    until(lambda: not slices(cluster), 120, "no ResourceSlice of the driver")
    record(cluster, "helm_uninstall_to_no_slice_s", round(time.monotonic() - started, 2))
    assert claim_specs() == []
    # what stays (docs/deploy.md, "Removing devinject")
    assert (STATE / "ledger.json").exists()
    assert sorted(p.name for p in Path("/var/run/cdi").glob("nvidia.com-*.yaml"))
    assert (HOST / "opt" / "devinject" / "hook").is_dir()
    assert cluster.json("node", cluster.node)["metadata"]["labels"].get("devinject.io/accelerators") == "true"
