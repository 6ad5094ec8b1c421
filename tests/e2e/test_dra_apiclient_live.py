"""The DRA driver's API client on the real control plane (test_dra_live.py's cluster): the driver runs as the
DaemonSet's service account would (deploy/kubernetes/dra/rbac.yaml), with a token bound to a Secret in a
kubeconfig's `tokenFile`, and reaches the API server through a TCP proxy in this process that the tests can
cut (the API server itself is never stopped: the cluster's other parts need it) and that counts the
driver's connections (a GET may go over a connection an earlier answer came on, kept open up to 30 s;
anything else opens one of its own, and the watch has its own).

- the token is replaced in the file and the old one revoked (its Secret deleted): the driver keeps
  restoring slices and preparing claims, with no restart;
- a slice deleted or edited by someone else is restored at once (the watch; the rescan is 10 minutes here);
- an idle driver opens no connection to the API server (its watch is the one it has);
- the API server unreachable for a minute: a prepared claim's pod keeps running and the claim is answered
  again from the checkpoint, a pod created meanwhile runs once it is back, and a slice deleted meanwhile is
  published again.

A missing prerequisite fails, never skips."""

from __future__ import annotations

import base64
import json
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from devinject.dra.api import dra_v1_pb2 as dra
from devinject.dra.api import dra_v1_pb2_grpc as dra_grpc
from tests.e2e.conftest import REPO
from tests.e2e.kube import until
from tests.e2e.test_dra_live import DEVINJECT, DRIVER, HOST, KUBE_DIR, STATE, Cluster, claim_pod
from tests.e2e.test_dra_live import cluster as base_cluster

cluster = base_cluster  # the cluster of test_dra_live.py's fixture, for this module

pytestmark = pytest.mark.live

NAMESPACE, ACCOUNT = "devinject-system", "devinject-dra"
API = ("127.0.0.1", 6443)
LOG = REPO / "build" / "dra-apiclient-driver.log"  # kept: the cluster's logs go with it


class Proxy:
    """TCP between the driver and the API server, which `cut()` stops (listener closed, every connection
    reset) and `restore()` starts again on the same port. `opened` counts the connections made."""

    def __init__(self) -> None:
        self.port = 0
        self.opened = 0
        self.lock = threading.Lock()
        self.connections: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(API, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.opened += 1
                self.connections += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1)
                for side in ready:
                    data = side.recv(65536)
                    if not data:
                        return
                    (b if side is a else a).sendall(data)
        except OSError:
            pass
        finally:
            for side in (a, b):
                side.close()

    def cut(self) -> None:
        assert self.listener is not None
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept blocked on it (a close alone would not)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for connection in self.connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connections = []

    def close(self) -> None:
        self.cut()


class Driver:
    def __init__(self, cluster: Cluster, proxy: Proxy, token_file: Path) -> None:
        self.cluster, self.proxy, self.token_file = cluster, proxy, token_file

    def token(self, secret: str) -> str:
        self.cluster.kubectl("create", "secret", "generic", secret, "-n", NAMESPACE, "--from-literal=x=y")
        return self.cluster.kubectl("create", "token", ACCOUNT, "-n", NAMESPACE, "--bound-object-kind", "Secret",
                                    "--bound-object-name", secret, "--duration", "1h").strip()

    def accepted(self, token: str) -> bool:
        """Whether the API server takes `token` (a kubeconfig of it alone, straight to the API server)."""
        path = KUBE_DIR / "token-check.kubeconfig"
        path.write_text(kubeconfig(f"https://{API[0]}:{API[1]}", {"token": token}))
        done = subprocess.run([str(KUBE_DIR / "bin" / "kubectl"), "--kubeconfig", str(path), "get",
                               "resourceslices", "-o", "name"], capture_output=True, text=True, timeout=60)
        path.unlink()
        return done.returncode == 0

    def slice_names(self) -> list[str]:
        return sorted(s["metadata"]["name"] for s in self.cluster.slices())


def kubeconfig(server: str, user: dict[str, str]) -> str:
    admin = yaml.safe_load((KUBE_DIR / "admin.kubeconfig").read_text())
    ca = admin["clusters"][0]["cluster"].get("certificate-authority-data") or base64.b64encode(
        Path(admin["clusters"][0]["cluster"]["certificate-authority"]).read_bytes()).decode()
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "driver",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": ACCOUNT, "user": user}],
        "contexts": [{"name": "driver", "context": {"cluster": "c", "user": ACCOUNT}}]})


@pytest.fixture(scope="module")
def driver(cluster: Cluster) -> Iterator[Driver]:
    cluster.stop_driver()
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("apply", "-f", str(REPO / "deploy/kubernetes/dra/rbac.yaml"))
    proxy = Proxy()
    token_file = KUBE_DIR / "driver-token"
    config = KUBE_DIR / "driver.kubeconfig"
    config.write_text(kubeconfig(f"https://127.0.0.1:{proxy.port}", {"tokenFile": str(token_file)}))
    tools = Driver(cluster, proxy, token_file)
    token_file.write_text(tools.token("token-one"))
    (REPO / "build").mkdir(exist_ok=True)
    handle = open(LOG, "wb")  # noqa: SIM115 - the driver's own log, kept for the report
    cluster.driver = subprocess.Popen(
        [DEVINJECT, "dra-driver", "--host-root", str(HOST), "--node-name", cluster.node, "--kubeconfig",
         str(config), "--state-dir", str(STATE), "--hook-path", DEVINJECT, "--rescan", "600"],
        stdout=handle, stderr=handle, stdin=subprocess.DEVNULL)
    handle.close()
    try:
        until(lambda: len(cluster.slices()) == 3, 60, "the driver's ResourceSlices, as its service account")
        yield tools
    finally:
        cluster.stop_driver()
        proxy.close()


def run_pod(cluster: Cluster, name: str, timeout: float = 120) -> None:
    claim_pod(cluster, name, [("gpu", "gpu.devinject.io", 1)], match=False)
    until(lambda: cluster.running(name), timeout, f"pod {name} Running")


def test_a_replaced_token_is_used_and_the_revoked_one_never_again(driver: Driver) -> None:
    cluster = driver.cluster
    old = driver.token_file.read_text()
    new = driver.token("token-two")
    replacement = driver.token_file.with_suffix(".new")
    replacement.write_text(new)
    replacement.replace(driver.token_file)  # as the kubelet rotates a projected token: a rename
    cluster.kubectl("delete", "secret", "token-one", "-n", NAMESPACE, "--wait=true")
    until(lambda: not driver.accepted(old), 30, "the old token revoked with its Secret")
    assert driver.accepted(new)
    slices = driver.slice_names()
    cluster.kubectl("delete", "resourceslice", slices[0])
    until(lambda: driver.slice_names() == slices, 30, "the deleted slice restored with the new token")
    run_pod(cluster, "after-rotation")
    cluster.delete_pod("after-rotation")
    log = LOG.read_text()
    assert "Traceback" not in log


def test_a_slice_deleted_or_edited_by_someone_else_is_restored_at_once(driver: Driver) -> None:
    cluster = driver.cluster
    slices = driver.slice_names()
    started = time.monotonic()
    cluster.kubectl("delete", "resourceslice", slices[1])
    until(lambda: driver.slice_names() == slices, 20, "the deleted slice restored (watch)", every=0.1)
    restored = time.monotonic() - started
    gpu = next(s for s in cluster.slices() if s["spec"]["pool"]["name"].endswith("-gpu"))
    devices = len(gpu["spec"]["devices"])
    name = gpu["metadata"]["name"]
    patch = json.dumps([{"op": "remove", "path": "/spec/devices/0"}])
    cluster.kubectl("patch", "resourceslice", name, "--type", "json", "-p", patch)
    until(lambda: len(cluster.json("resourceslice", name)["spec"]["devices"]) == devices, 20,
          "the edited slice restored (watch)", every=0.1)
    assert restored < 10, restored  # the rescan is 600 s: only the watch can have done it


def test_an_idle_driver_opens_no_connection_to_the_api_server(driver: Driver) -> None:
    time.sleep(3)  # what the previous test set off has settled
    before = driver.proxy.opened
    time.sleep(30)
    assert driver.proxy.opened == before


def prepare_again(cluster: Cluster, claim: dict[str, object]) -> dra.NodePrepareResourcesResponse:
    meta = claim["metadata"]
    assert isinstance(meta, dict)
    endpoint = f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock"
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        return dra_grpc.DRAPluginStub(channel).NodePrepareResources(dra.NodePrepareResourcesRequest(  # type: ignore[no-untyped-call]
            claims=[dra.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])]), timeout=10)


def test_an_api_server_away_for_a_minute_costs_only_a_delay(driver: Driver) -> None:
    cluster = driver.cluster
    run_pod(cluster, "before-outage")
    claim = cluster.claim_of("before-outage")
    slices = driver.slice_names()
    driver.proxy.cut()
    cut_at = time.monotonic()
    try:
        cluster.kubectl("delete", "resourceslice", slices[-1])  # the NICs' (the GPUs' stay: the pod below is placed)
        claim_pod(cluster, "during-outage", [("gpu", "gpu.devinject.io", 1)], match=False)
        answer = prepare_again(cluster, claim).claims[claim["metadata"]["uid"]]
        assert answer.error == "" and len(answer.devices) == 1  # from the checkpoint: no API call
        time.sleep(max(0.0, 60 - (time.monotonic() - cut_at)))
        assert cluster.running("before-outage")
        assert driver.slice_names() != slices
    finally:
        driver.proxy.restore()
    until(lambda: driver.slice_names() == slices, 60, "the slices published again once it is back")
    cluster.until_running("during-outage", 180, "the pod made during the outage Running")
    for pod in ("before-outage", "during-outage"):
        cluster.delete_pod(pod)
    assert "Traceback" not in LOG.read_text()
