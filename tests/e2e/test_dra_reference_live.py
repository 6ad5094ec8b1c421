"""devinject's DRA scenario list against Kubernetes' own reference driver (`dra-test-driver kubelet-plugin`,
test/e2e/dra/test-driver of the cluster's tree, driver `test-driver.cdi.k8s.io`, `--num-devices 4`), on the
same real control plane as test_dra_live.py (its `cluster` fixture: ../shared/kube/cluster-up.sh with
CONTAINERD=bundled, always taken down with `cluster-down.sh --purge`; devinject's driver over the 4-switch HGX
tree). Each scenario is written once, as a function of the driver under test, and runs for both: the same
assertions hold for the reference and for devinject.

- the driver's slices published for the node and read back through the API;
- a claim for 2 devices allocated by the scheduler, reserved for the pod, the pod Running with the driver's
  CDI edits (the reference's are env variables, devinject's device nodes and mounts: whatever the claim's spec
  files in /var/run/cdi say) seen inside it, and the specs gone once the pod is;
- a claim for one device more than the class has leaves the pod Pending with the scheduler's reason;
- the driver restarted with a claim prepared: the pod keeps running and the spec stays, and once the kubelet
  has unprepared the claim through the restarted driver (its DRA checkpoint forgets the claim) the spec is
  gone. The reference fails this last step, reported as XFAIL with the reason: it keeps its prepared claims
  in memory only, so restarted it answers NodeUnprepareResources for a claim it no longer knows with success
  and leaves the claim's spec in /var/run/cdi;
- an extended-resource pod (`limits` only) served through a DeviceClass with `extendedResourceName`;
- opaque config the driver refuses (`{"mode": 1}`: devinject's GpuConfig has no such field, the reference only
  string-to-string maps) is its error in the pod's events, the pod Pending, no spec left.

Not applicable to the reference driver, so only in test_dra_live.py:
- `matchAttribute: resource.kubernetes.io/pcieRoot` (two GPUs under one root, a GPU and a NIC co-located): the
  reference publishes devices with no attributes and of one kind;
- MIG instances and their whole GPU (shared counters): the reference publishes no counters or partitions;
- device health (a fault leaving the slice, `allocatedResourcesStatus`): the reference serves
  NodeWatchResources but sends empty updates (every 2 s, its log says), with no flag or file to make a device
  unhealthy from outside its process;
- the figures (pod-to-Running timing against the reference, which test_dra_live.py already measures in one
  run; the 1,024-device host's publish time; RSS): measurements, not assertions.

A missing prerequisite fails, never skips. Run it under the cluster lock:
`flock /tmp/devinject-kube.lock .venv/bin/pytest -q tests/e2e/test_dra_reference_live.py`."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_dra_live
from tests.e2e.conftest import terminate
from tests.e2e.kube import need, until
from tests.e2e.test_dra_live import CDI, DRIVER, KUBE_DIR, SLEEPER, Cluster

pytestmark = pytest.mark.live

cluster = test_dra_live.cluster  # its module fixture: the cluster up, devinject's driver running, torn down after

REFERENCE = "test-driver.cdi.k8s.io"
REFERENCE_DEVICES = 4
REGISTRY = Path("/var/lib/kubelet/plugins_registry")
KUBELET_STATE = Path("/var/lib/kubelet/dra_manager_state")  # the kubelet's DRA checkpoint (pkg/kubelet/cm/dra)
# a string-to-number map: devinject refuses any opaque config, the reference anything but string to string
BAD_CONFIG = {"mode": 1}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass
class Driver:
    """A DRA driver under test, as the scenarios see it."""

    key: str  # a DNS-label prefix for the objects a scenario makes
    name: str  # the driver's name in slices and allocation results
    device_class: str  # a DeviceClass selecting `devices` of its devices
    selector: str  # that class's CEL expression
    devices: int
    published: int  # devices in its slices for the node
    refusal: str  # what its error says for BAD_CONFIG
    restart: Callable[[], None]
    restart_gap: str = ""  # why a claim prepared before a restart is not cleaned after it, when it is not


class Reference:
    """`dra-test-driver kubelet-plugin` run on the host with the admin kubeconfig, as cluster-selftest.sh
    runs it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.binary = KUBE_DIR / "bin" / "dra-test-driver"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = KUBE_DIR / "logs" / "dra-test-driver-reference.log"

    def start(self) -> None:
        # the driver does not make its socket directory (../shared/kube/README.md)
        Path("/var/lib/kubelet/plugins", REFERENCE).mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [str(self.binary), f"--kubeconfig={KUBE_DIR / 'admin.kubeconfig'}", "-v=3", "kubelet-plugin",
                 f"--node-name={self.cluster.node}", f"--num-devices={REFERENCE_DEVICES}"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        until(lambda: (REGISTRY / f"{REFERENCE}-reg.sock").exists() and slices(self.cluster, REFERENCE), 60,
              "the reference driver's registration socket and slice")

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
            self.process = None

    def restart(self) -> None:
        restart(REFERENCE, self.stop, self.start)


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> Iterator[Reference]:
    driver = Reference(cluster)
    need(driver.binary.exists(), f"{driver.binary} (cluster-up.sh unpacks it)")
    cluster.apply(device_class("test-driver.reference.io", f'device.driver == "{REFERENCE}"'))
    try:
        driver.start()
        yield driver
    finally:
        driver.stop()


def restart(driver: str, stop: Callable[[], None], start: Callable[[], None]) -> None:
    """Stop and start a driver, and wait until the new one serves: its registration socket, gone with the old
    process, made again (both drivers clean up what they clean at start before they make it)."""
    socket = REGISTRY / f"{driver}-reg.sock"
    stop()
    until(lambda: not socket.exists(), 30, f"the stopped {driver} driver's registration socket gone")
    start()
    until(socket.exists, 60, f"the restarted {driver} driver's registration socket")


@pytest.fixture(params=["devinject", "reference"])
def driver(request: pytest.FixtureRequest, cluster: Cluster) -> Driver:
    if request.param == "reference":
        ref: Reference = request.getfixturevalue("reference")
        return Driver("reference", REFERENCE, "test-driver.reference.io", f'device.driver == "{REFERENCE}"',
                      REFERENCE_DEVICES, REFERENCE_DEVICES, "decoding user parameters", ref.restart,
                      "keeps its prepared claims in memory only (no checkpoint): restarted, it answers the kubelet's "
                      "NodeUnprepareResources for a claim it no longer knows with success and removes nothing")
    gpu = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].kind == "nvidia.com/gpu"'
    return Driver("devinject", DRIVER, "gpu.devinject.io", gpu, 8, 14, "parameters.'mode': unknown field",
                  lambda: restart(DRIVER, cluster.stop_driver, cluster.start_driver))


def device_class(name: str, selector: str, extended: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": selector}}]}
    if extended:
        spec["extendedResourceName"] = extended
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def slices(cluster: Cluster, driver: str) -> list[dict[str, Any]]:
    items = cluster.json("resourceslices", "--field-selector", f"spec.driver={driver}")["items"]
    return [s for s in items if s["spec"].get("nodeName") == cluster.node]


def container(resources: dict[str, Any]) -> dict[str, Any]:
    return {"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never", "command": SLEEPER,
            "resources": resources}


@contextlib.contextmanager
def claim_pod(cluster: Cluster, name: str, driver: Driver, count: int,
              config: dict[str, Any] | None = None) -> Iterator[None]:
    """A pod with a ResourceClaimTemplate for `count` devices of the driver's class (`config` as its opaque
    parameters), deleted after."""
    devices: dict[str, Any] = {"requests": [{"name": "dev", "exactly": {
        "deviceClassName": driver.device_class, "count": count, "allocationMode": "ExactCount"}}]}
    if config is not None:
        devices["config"] = [{"requests": ["dev"], "opaque": {"driver": driver.name, "parameters": config}}]
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
         "spec": {"spec": {"devices": devices}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
         "spec": {"terminationGracePeriodSeconds": 1,
                  "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": name}],
                  "containers": [container({"claims": [{"name": "devices"}]})]}})
    try:
        yield
    finally:
        cluster.delete_pod(name)


def running_claim(cluster: Cluster, pod: str) -> dict[str, Any]:
    cluster.until_running(pod)
    return cluster.claim_of(pod)


def claim_specs(driver: Driver, claim: dict[str, Any]) -> list[Path]:
    """The claim-scoped CDI spec files the driver wrote (devinject: `<driver>-<uid>.json`, the reference one
    per request: `<driver>-<uid>-<request>.json`)."""
    return sorted(CDI.glob(f"{driver.name}-{claim['metadata']['uid']}*.json"))


def assert_allocated_and_seen(cluster: Cluster, driver: Driver, pod: str, claim: dict[str, Any],
                              count: int) -> None:
    """The claim holds `count` distinct devices of the driver, reserved for `pod`, and every CDI edit of its
    spec files (env, device nodes, mounts) is in the pod's container."""
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == count and {r["driver"] for r in results} == {driver.name}, results
    assert len({(r["pool"], r["device"]) for r in results}) == count, results
    assert [r["name"] for r in claim["status"]["reservedFor"]] == [pod]
    files = claim_specs(driver, claim)
    assert files, f"no CDI spec for claim {claim['metadata']['name']} in {CDI}"
    env: set[str] = set()
    paths: set[str] = set()
    for file in files:
        spec = json.loads(file.read_text())
        for edits in [spec.get("containerEdits") or {}, *(d["containerEdits"] for d in spec["devices"])]:
            env.update(edits.get("env") or [])
            paths.update(n["path"] for n in edits.get("deviceNodes") or [])
            paths.update(m["containerPath"] for m in edits.get("mounts") or [])
    assert env or paths, f"{files}: no edits"
    probe = "env; for p in " + " ".join(sorted(paths)) + '; do test -e "$p" && echo "present:$p"; done'
    seen = set(cluster.kubectl("exec", pod, "--", "sh", "-c", probe).splitlines())
    assert not env - seen, f"env of the claim's spec missing in pod {pod}: {sorted(env - seen)}"
    missing = {p for p in paths if f"present:{p}" not in seen}
    assert not missing, f"paths of the claim's spec missing in pod {pod}: {sorted(missing)}"


def kubelet_holds(uid: str) -> bool:
    """The kubelet's DRA checkpoint names the claim: prepared, and not yet unprepared by its driver."""
    return KUBELET_STATE.exists() and uid in KUBELET_STATE.read_text()


def scheduling_failure(cluster: Cluster, pod: str) -> str | None:
    conditions = cluster.pod(pod)["status"].get("conditions", [])
    return next((c.get("message", "") for c in conditions
                 if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message")), None)


def test_slices_are_published_for_the_node_and_read_back(cluster: Cluster, driver: Driver) -> None:
    read = slices(cluster, driver.name)
    assert read, f"no ResourceSlice of {driver.name} for node {cluster.node}"
    pools: dict[str, list[dict[str, Any]]] = {}
    for item in read:
        pools.setdefault(item["spec"]["pool"]["name"], []).append(item)
    for pool, members in pools.items():
        assert {m["spec"]["pool"]["resourceSliceCount"] for m in members} == {len(members)}, pool
        assert len({m["spec"]["pool"]["generation"] for m in members}) == 1, pool
        names = [d["name"] for m in members for d in m["spec"].get("devices", [])]
        assert len(names) == len(set(names)) and all(DNS_LABEL.match(n) for n in names), names
    assert sum(len(s["spec"].get("devices", [])) for s in read) == driver.published


def test_a_claim_for_two_devices_runs_with_the_drivers_cdi_edits_in_the_pod(cluster: Cluster,
                                                                           driver: Driver) -> None:
    name = f"{driver.key}-two"
    with claim_pod(cluster, name, driver, 2):
        claim = running_claim(cluster, name)
        assert_allocated_and_seen(cluster, driver, name, claim, 2)
    until(lambda: not claim_specs(driver, claim), 60, f"the specs of {name}'s claim removed (unprepared)")


def test_a_claim_the_class_cannot_meet_stays_pending_with_the_schedulers_reason(cluster: Cluster,
                                                                                driver: Driver) -> None:
    name = f"{driver.key}-too-many"
    with claim_pod(cluster, name, driver, driver.devices + 1):
        message = until(lambda: scheduling_failure(cluster, name), 60, f"the scheduler's reason for {name}")
        assert "cannot allocate all claims" in message, message
        assert cluster.pod(name)["status"]["phase"] == "Pending"


def test_a_restarted_driver_keeps_the_prepared_claim_and_cleans_it_on_delete(cluster: Cluster,
                                                                             driver: Driver) -> None:
    name = f"{driver.key}-kept"
    with claim_pod(cluster, name, driver, 1):
        claim = running_claim(cluster, name)
        files = claim_specs(driver, claim)
        assert files and kubelet_holds(claim["metadata"]["uid"]), "the claim is not prepared"
        driver.restart()
        assert claim_specs(driver, claim) == files, "the restart lost the prepared claim's spec"
        assert cluster.running(name), f"pod {name} stopped running over the driver's restart"
        assert_allocated_and_seen(cluster, driver, name, cluster.claim_of(name), 1)
    uid = claim["metadata"]["uid"]
    until(lambda: not kubelet_holds(uid), 90, f"the kubelet to unprepare {name}'s claim through the restarted driver")
    left = claim_specs(driver, claim)
    if left and driver.restart_gap:
        pytest.xfail(f"{driver.name} {driver.restart_gap}: {[p.name for p in left]} left behind")
    assert not left, f"the restarted driver answered the kubelet's unprepare and left {left}"


def test_an_extended_resource_pod_is_served_through_the_device_class(cluster: Cluster, driver: Driver) -> None:
    """A DeviceClass of the driver's devices with `extendedResourceName` (DRAExtendedResource, beta and on):
    a pod asking only `limits: {<name>: 1}` gets one device through a claim the scheduler makes."""
    name, resource = f"{driver.key}-extended", f"example.com/{driver.key}-device"
    cluster.apply(device_class(name, driver.selector, resource),
                      {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                       "spec": {"terminationGracePeriodSeconds": 1,
                                "containers": [container({"limits": {resource: "1"}})]}})
    try:
        cluster.until_running(name)
        status = cluster.pod(name)["status"]
        claim = cluster.json("resourceclaim", status["extendedResourceClaimStatus"]["resourceClaimName"])
        assert_allocated_and_seen(cluster, driver, name, claim, 1)
    finally:
        cluster.delete_pod(name)
        cluster.kubectl("delete", "deviceclass", name, "--ignore-not-found")
    until(lambda: not claim_specs(driver, claim), 60, f"the specs of {name}'s claim removed (unprepared)")


def test_opaque_config_the_driver_refuses_is_its_error_in_the_pods_events(cluster: Cluster,
                                                                          driver: Driver) -> None:
    name = f"{driver.key}-refused"
    def event() -> str | None:
        events = cluster.json("events", "--field-selector", f"involvedObject.name={name}")["items"]
        return next((e["message"] for e in events if driver.refusal in e.get("message", "")), None)

    with claim_pod(cluster, name, driver, 1, config=BAD_CONFIG):
        message = until(event, 90, f"the driver's error in {name}'s events")
        claim = cluster.claim_of(name)
        assert claim["metadata"]["name"] in message, f"the event does not name the claim: {message}"
        assert cluster.pod(name)["status"]["phase"] == "Pending"
        assert not claim_specs(driver, claim), "a spec was left for the refused claim"
