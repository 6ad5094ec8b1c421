"""DRA features behind gates that are off in 1.36, on a real Kubernetes 1.36 API server with the gates on:
../shared/kube's cluster-up.sh takes no extra API server flags, so this module runs a second kube-apiserver of
its own (the cluster's binary, etcd under a prefix of its own, the cluster's certificates) with
`GenericWorkload`, `DRAWorkloadResourceClaims` and `DRADeviceTaintRules` on, `scheduling.k8s.io/v1alpha2` and
`resource.k8s.io/v1beta2` served. No kubelet or scheduler talks to it: the objects are the API server's own,
what the driver and doctor read is what it serves.

- A claim reserved for a PodGroup: a PodGroup, pods that name it in `spec.schedulingGroup` (two on this
  node, one on another, one in no group) and a claim whose `status.reservedFor` names the group; the driver,
  as the shipped RBAC lets its service account act (a token of its account), prepares the claim: it is
  booked for the group's two pods on this node and no other, and unprepared, released. Before, the booking
  named no pod.
- A DeviceTaintRule (v1beta2, as 1.36 serves it) selecting a GPU the driver published: doctor's slice link
  names it, its effect and the command that removes it; deleted, the link holds.

A missing prerequisite fails, never skips. The cluster is taken down (`cluster-down.sh --purge`). Run it under
the cluster lock: `flock /tmp/devinject-kube.lock .venv/bin/pytest -q tests/e2e/test_dra_podgroup_live.py`."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devinject.dra.driver import DraDriver, DraOptions
from devinject.dra.kubeapi import credentials
from devinject.dra.publisher import SlicePublisher
from devinject.nodestate.ledger import Ledger
from devinject.specs.generate import GenerateOptions
from tests.conftest import HOSTS
from tests.e2e.conftest import REPO
from tests.e2e.kube import KUBE, KubeClient, need, until

pytestmark = pytest.mark.live

KUBE_DIR = Path("/tmp/devinject-podgroup-test")
DRIVER = "dra.devinject.io"
NAMESPACE, GROUP = "training", "trainers"
GATES = "GenericWorkload=true,DRAWorkloadResourceClaims=true,DRADeviceTaintRules=true,SizeBasedListCostEstimate=false"
APIS = "scheduling.k8s.io/v1alpha2=true,resource.k8s.io/v1beta2=true"
DEVICE = "gpu-0000-2a-00-0"


class GatedApi(KubeClient):
    """kubectl against this module's own API server (the gates on), as the admin."""

    def __init__(self, port: int) -> None:
        super().__init__(KUBE_DIR, "debian")
        self.port = port
        self.server: subprocess.Popen[bytes] | None = None
        self.env["KUBECONFIG"] = str(KUBE_DIR / "gated-admin.kubeconfig")

    def kubeconfig(self, path: Path, user: dict[str, str]) -> Path:
        ca = base64.b64encode((KUBE_DIR / "pki" / "ca.crt").read_bytes()).decode()
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "gated",
            "clusters": [{"name": "gated", "cluster": {"server": f"https://127.0.0.1:{self.port}",
                                                       "certificate-authority-data": ca}}],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "gated", "context": {"cluster": "gated", "user": "u"}}]}))
        return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_gated_server(api: GatedApi, advertise: str) -> None:
    pki = KUBE_DIR / "pki"
    handle = open(KUBE_DIR / "logs" / "gated-apiserver.log", "ab")  # noqa: SIM115 - its log, kept with the cluster's
    api.server = subprocess.Popen(
        [str(KUBE_DIR / "bin" / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379",
         f"--etcd-prefix=/devinject-podgroup-{os.getpid()}", "--bind-address=127.0.0.1",
         f"--secure-port={api.port}", f"--advertise-address={advertise}", "--service-cluster-ip-range=10.96.0.0/24",
         f"--client-ca-file={pki}/ca.crt", f"--tls-cert-file={pki}/apiserver.crt",
         f"--tls-private-key-file={pki}/apiserver.key",
         "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
         f"--service-account-key-file={pki}/sa.pub", f"--service-account-signing-key-file={pki}/sa.key",
         "--authorization-mode=RBAC", f"--feature-gates={GATES}", f"--runtime-config={APIS}",
         "--profiling=false", "--v=1"], stdout=handle, stderr=handle, stdin=subprocess.DEVNULL)
    handle.close()
    api.kubeconfig(KUBE_DIR / "gated-admin.kubeconfig",
                   {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")})

    def ready() -> bool:
        assert api.server is not None and api.server.poll() is None, "the gated kube-apiserver exited"
        return api.kubectl("get", "--raw", "/readyz", check=False, timeout=10).strip() == "ok"

    until(ready, 120, "the gated kube-apiserver ready")


def stop_gated_server(api: GatedApi) -> None:
    if api.server is not None and api.server.poll() is None:
        api.server.send_signal(signal.SIGTERM)
        try:
            api.server.wait(5)  # it idles 12-15 s after it stopped listening (../shared/kube's README): killed
        except subprocess.TimeoutExpired:
            api.server.kill()
            api.server.wait(10)
    api.server = None


@pytest.fixture(scope="module")
def api() -> Iterator[GatedApi]:
    need(os.geteuid() == 0, "needs root")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh")
    made = GatedApi(free_port())
    cluster = KubeClient(KUBE_DIR, "debian")
    try:
        up = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=cluster.env,
                            timeout=600)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        node = cluster.json("nodes")["items"][0]
        address = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
        start_gated_server(made, address)
        yield made
    finally:
        stop_gated_server(made)
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=cluster.env,
                       timeout=300)
        shutil.rmtree(KUBE_DIR / "etcd-data", ignore_errors=True)


def pod(name: str, node: str, group: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "automountServiceAccountToken": False,
                            "containers": [{"name": "c", "image": "localhost/busybox:1"}]}
    if group is not None:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


NODE = "node1"


@pytest.fixture(scope="module")
def driver(api: GatedApi, tmp_path_factory: pytest.TempPathFactory) -> DraDriver:
    """The DRA driver over the HGX fixture as node1's, acting as the shipped RBAC lets its service account act
    (a token of its account on the gated API server), its slices published there."""
    work = tmp_path_factory.mktemp("gated-driver")
    api.kubectl("apply", "-f", str(REPO / "deploy/kubernetes/dra/namespace.yaml"),
                "-f", str(REPO / "deploy/kubernetes/dra/rbac.yaml"))
    token = api.kubectl("create", "token", "devinject-dra", "-n", "devinject-system", "--duration", "30m").strip()
    config = api.kubeconfig(work / "driver.kubeconfig", {"token": token})
    dirs = {name: str(work / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    gen = GenerateOptions(root=str(HOSTS / "hgx-h100"), hook_path="/usr/bin/devinject")
    opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"], registry_dir=dirs["registry"],
                      cdi_dir=dirs["cdi"], state_dir=dirs["state"], rescan=3600)
    made = DraDriver(opts, SlicePublisher(credentials(str(config)), DRIVER, NODE))
    made.refresh()
    assert api.json("resourceslices")["items"], "the driver's slices on the gated API server"
    return made


def test_a_claim_reserved_for_a_podgroup_is_booked_for_the_groups_pods_on_the_node(api: GatedApi,
                                                                                   driver: DraDriver) -> None:
    api.kubectl("create", "namespace", NAMESPACE)
    api.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NAMESPACE}})
    api.apply({"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
               "metadata": {"name": GROUP, "namespace": NAMESPACE},
               "spec": {"schedulingPolicy": {"basic": {}}}})
    group_uid = api.json("podgroup", GROUP, "-n", NAMESPACE)["metadata"]["uid"]
    api.apply(pod("worker-0", NODE, GROUP), pod("worker-1", NODE, GROUP), pod("worker-far", "node2", GROUP),
              pod("loner", NODE, None))
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.json("pods", "-n", NAMESPACE)["items"]}
    assert api.json("pod", "worker-0", "-n", NAMESPACE)["spec"]["schedulingGroup"] == {"podGroupName": GROUP}
    api.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
               "metadata": {"name": "shared", "namespace": NAMESPACE},
               "spec": {"devices": {"requests": [{"name": "gpu",
                                                  "exactly": {"deviceClassName": "gpu.devinject.io"}}]}}})
    pool = f"{NODE}-nvidia-com-gpu"
    status = {"status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": pool, "device": DEVICE}]}},
        "reservedFor": [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": GROUP, "uid": group_uid}]}}
    api.kubectl("patch", "resourceclaim", "shared", "-n", NAMESPACE, "--subresource=status", "--type=merge",
                "-p", json.dumps(status))
    claim = api.json("resourceclaim", "shared", "-n", NAMESPACE)
    assert claim["status"]["reservedFor"][0]["resource"] == "podgroups", claim["status"]
    uid = claim["metadata"]["uid"]
    (device,) = driver.preparer.prepare(NAMESPACE, "shared", uid)
    assert (device.pool, device.device) == (pool, DEVICE)
    state = driver.opts.state_dir
    booking = Ledger(state).snapshot()["allocations"][f"dra-claim:{DRIVER}:{uid}"]
    assert booking["pods"] == sorted((uids["worker-0"], uids["worker-1"])), (booking, uids)
    assert list(driver.preparer.prepared()[uid].pods or ()) == booking["pods"]
    driver.preparer.unprepare(uid)
    assert f"dra-claim:{DRIVER}:{uid}" not in Ledger(state).snapshot()["allocations"]
    assert not os.listdir(driver.opts.cdi_dir)


def test_doctor_names_a_device_taint_rule_that_drains_a_published_gpu(api: GatedApi, driver: DraDriver) -> None:
    from devinject.api import Node
    from devinject.doctor import DoctorOptions, check_link, slice_api

    gpu = "gpu-0000-18-00-0"  # nvidia.com/gpu=0 of the HGX fixture
    options = DoctorOptions(api=slice_api(str(KUBE_DIR / "gated-admin.kubeconfig")), node_name=NODE,
                            metrics_address=None)
    node = Node(str(HOSTS / "hgx-h100"))
    before = check_link(node, "nvidia.com/gpu=0", "slice", options)
    assert before.ok is True and "DeviceTaintRules not checked" not in before.detail, before
    api.apply({"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule", "metadata": {"name": "rma-gpu0"},
               "spec": {"deviceSelector": {"driver": DRIVER, "pool": f"{NODE}-nvidia-com-gpu", "device": gpu},
                        "taint": {"key": "example.com/rma", "value": "ticket-42", "effect": "NoSchedule"}}})
    check = check_link(node, "nvidia.com/gpu=0", "slice", options)
    assert check.ok is False, check
    assert "example.com/rma=ticket-42:NoSchedule since " in check.detail
    assert check.detail.endswith("by DeviceTaintRule rma-gpu0"), check.detail
    assert check.fix.endswith("kubectl delete devicetaintrule rma-gpu0")
    api.kubectl("delete", "devicetaintrule", "rma-gpu0")
    assert check_link(node, "nvidia.com/gpu=0", "slice", options).ok is True
