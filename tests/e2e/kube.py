"""What the live tests on real Kubernetes share: where ../shared/kube's scripts are, a prerequisite that fails
(never skips), and a bounded wait."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.conftest import REPO

# the cluster's scripts (their README): where DEVINJECT_KUBE points, beside the checkout, or the machine's own
KUBE = next((p for p in (Path(os.environ.get("DEVINJECT_KUBE", REPO.parent / "shared" / "kube")),
                         REPO.parent / "shared" / "kube", Path("/work/shared/kube")) if (p / "cluster-up.sh").exists()),
            REPO.parent / "shared" / "kube")
T = TypeVar("T")


def need(condition: object, reason: str) -> None:
    """A prerequisite: missing, the test fails (CI must never pass by skipping the cluster)."""
    if not condition:
        pytest.fail(f"live test prerequisite missing: {reason}", pytrace=False)


def until(condition: Callable[[], T | None], timeout: float, what: str, every: float = 0.2) -> T:
    """`condition()`'s first truthy value, polled every `every` s; an AssertionError naming `what` after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


class KubeClient:
    """kubectl against the cluster `cluster-up.sh` keeps in `kube_dir`, with the environment its scripts read
    (KUBE_DIR, CONTAINERD, KUBECONFIG)."""

    def __init__(self, kube_dir: Path, containerd: str) -> None:
        self.kube_dir = kube_dir
        self.env = {**os.environ, "KUBE_DIR": str(kube_dir), "CONTAINERD": containerd,
                    "KUBECONFIG": str(kube_dir / "admin.kubeconfig")}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        done = subprocess.run([str(self.kube_dir / "bin" / "kubectl"), *args], capture_output=True, text=True,
                              env=self.env, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def up(self) -> str:
        """The cluster started (`cluster-up.sh`, its output in the failure); its one node's name."""
        done = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=self.env,
                              timeout=600)
        assert done.returncode == 0, f"cluster-up.sh failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return str(self.json("nodes")["items"][0]["metadata"]["name"])

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, *manifests: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input="\n".join(json.dumps(m) for m in manifests))


class PodClock:
    """How long a pod takes from its create to Running, through the API server: the pod POSTed and a watch on
    it (started first, from the list's resourceVersion) that stops at the first event with phase Running. No
    kubectl process runs while the pod starts (a poll of `kubectl get` takes ~0.1 s of a 2-core machine and
    resolves no better), so the figure is the cluster's own: claim, scheduling, the kubelet, the runtime."""

    def __init__(self, kube_dir: Path, namespace: str = "default") -> None:
        from devinject.dra.kubeapi import ResourceApi, credentials

        self.api = ResourceApi(credentials(str(kube_dir / "admin.kubeconfig")))
        self.namespace = namespace
        self.created: dict[str, float] = {}  # pod name -> time.time() of its POST (for the logs' phases)

    def running(self, pod: dict[str, Any], timeout: float = 120) -> float:
        import threading

        name = pod["metadata"]["name"]
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        version = self.api.request("GET", path, query={"limit": "1"})["metadata"]["resourceVersion"]
        seen: dict[str, float] = {}
        done = threading.Event()

        def watch() -> None:
            try:
                for event in self.api.watch(path, {"fieldSelector": f"metadata.name={name}",
                                                   "resourceVersion": version}, seconds=int(timeout)):
                    status = event.get("object", {}).get("status")
                    if isinstance(status, dict) and status.get("phase") == "Running":
                        seen["at"] = time.monotonic()
                        return
            finally:
                done.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(0.2)  # the watch is open before the pod exists
        start = time.monotonic()
        self.created[name] = time.time()
        self.api.request("POST", path, pod)
        done.wait(timeout + 5)
        assert "at" in seen, f"pod {name} not Running within {timeout:g} s"
        return seen["at"] - start


SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; sleep 3600 & wait']
REFERENCE_DRIVER = "test-driver.cdi.k8s.io"
REFERENCE_CLASS = "test-driver.devinject.io"


def timed_pod(name: str, *, claim_template: str | None = None, limits: dict[str, int] | None = None) -> dict[str, Any]:
    """The pod the timing tests start: busybox sleeping, with a claim from `claim_template` or `limits`."""
    container: dict[str, Any] = {"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                                 "command": SLEEPER}
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    if claim_template is not None:
        spec["resourceClaims"] = [{"name": "devices", "resourceClaimTemplateName": claim_template}]
        container["resources"] = {"claims": [{"name": "devices"}]}
    if limits:
        container["resources"] = {"limits": dict(limits)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def one_device_template(name: str, device_class: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "dev", "exactly": {"deviceClassName": device_class, "count": 1,
                                            "allocationMode": "ExactCount"}}]}}}}


class ReferenceDriver:
    """Kubernetes' own e2e DRA driver (`dra-test-driver kubelet-plugin`, 4 devices, claim specs of env edits
    only) on the host, with a DeviceClass of its devices (REFERENCE_CLASS); `stop` ends it."""

    def __init__(self, client: KubeClient, node: str) -> None:
        import subprocess

        binary = client.kube_dir / "bin" / "dra-test-driver"
        need(binary.exists(), f"{binary} (cluster-up.sh unpacks it)")
        Path(f"/var/lib/kubelet/plugins/{REFERENCE_DRIVER}").mkdir(parents=True, exist_ok=True)
        with open(client.kube_dir / "logs" / "dra-test-driver-devinject.log", "ab") as log:
            self.process = subprocess.Popen(
                [str(binary), f"--kubeconfig={client.kube_dir / 'admin.kubeconfig'}", "-v=2", "kubelet-plugin",
                 f"--node-name={node}", "--num-devices=4"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        client.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": REFERENCE_CLASS},
                      "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{REFERENCE_DRIVER}"'}}]}})
        until(lambda: client.json("resourceslices", "--field-selector", f"spec.driver={REFERENCE_DRIVER}")["items"],
              60, "the reference driver's slice")

    def stop(self) -> None:
        from tests.e2e.conftest import terminate

        terminate(self.process)


def interleaved(client: KubeClient, clock: PodClock, variants: dict[str, Callable[[str], dict[str, Any]]],
                rounds: int, tag: str) -> dict[str, dict[str, float]]:
    """Each variant's pods' POST-to-Running (variant -> pod name -> seconds), `rounds` rounds with each variant
    once per round in turn: this machine is shared and noisy, so its noise falls on all of them. A variant is a
    callable given the pod's name that makes what the pod needs (its claim template: not timed) and answers the
    pod, named `<variant>-<tag>-<round>` (`tag`: a name no other pod of the cluster's logs has); the pod (and a
    template of its name) is deleted, and gone, before the next starts."""
    taken: dict[str, dict[str, float]] = {v: {} for v in variants}
    for n in range(rounds):
        for variant, make in variants.items():
            name = f"{variant}-{tag}-{n}"
            taken[variant][name] = clock.running(make(name))
            client.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true", timeout=120)
            client.kubectl("delete", "resourceclaimtemplate", name, "--ignore-not-found", timeout=60)
    return taken
