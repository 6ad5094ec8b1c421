"""A compromised node cannot rewrite another node's ResourceSlices, on the real API server
(../shared/kube/cluster-up.sh, Kubernetes 1.36): deploy/kubernetes/dra's RBAC lets the driver's service
account create, update and delete every slice, and its ValidatingAdmissionPolicy (admission.yaml) holds it to
the node its pod's bound token names (`authentication.kubernetes.io/node-name`). The driver of node A is
played by a token minted for a pod of the driver's service account bound to node A (`kubectl create token
--bound-object-kind Pod`); node A and node B are Node objects no kubelet runs for. Without the policy every
write below that must be refused goes through (the test says so first, then applies the shipped manifest).

A missing prerequisite fails, never skips. The cluster is taken down (`cluster-down.sh --purge`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO
from tests.e2e.kube import KUBE, KubeClient, need, until

pytestmark = pytest.mark.live

KUBE_DIR = Path("/tmp/devinject-vap-test")
DRA = REPO / "deploy" / "kubernetes" / "dra"
NAMESPACE, ACCOUNT = "devinject-system", "devinject-dra"
NODES = ("devinject-node-a", "devinject-node-b")
DRIVER = "dra.devinject.io"


class Api(KubeClient):
    def as_token(self, token: str, *args: str, input: str | None = None) -> tuple[int, str]:
        """kubectl as the bearer of `token` alone (no client certificate): (exit status, its output)."""
        done = subprocess.run(
            [str(self.kube_dir / "bin" / "kubectl"), "--kubeconfig", "/dev/null", "--server",
             "https://127.0.0.1:6443", "--certificate-authority", str(self.kube_dir / "pki" / "ca.crt"),
             "--token", token, *args], capture_output=True, text=True, env=self.env, input=input, timeout=60)
        return done.returncode, done.stdout + done.stderr


def slice_of(name: str, node: str | None, *, devices: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": DRIVER, "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                            "devices": [{"name": f"gpu-{i}"} for i in range(devices)]}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


def as_yaml(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest)  # JSON is YAML


@pytest.fixture(scope="module")
def api() -> Iterator[Api]:
    need(os.geteuid() == 0, "needs root")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh")
    made = Api(KUBE_DIR, "debian")
    try:
        up = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=made.env, timeout=600)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        made.kubectl("apply", "-f", str(DRA / "namespace.yaml"), "-f", str(DRA / "rbac.yaml"))
        for node in NODES:  # nodes no kubelet runs for: their pods only need to be bound there
            made.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        for node in NODES:
            made.apply({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": f"driver-on-{node}", "namespace": NAMESPACE},
                        "spec": {"serviceAccountName": ACCOUNT, "nodeName": node,
                                 "containers": [{"name": "driver", "image": "localhost/busybox:1"}]}})
        yield made
    finally:
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=made.env, timeout=300)
        shutil.rmtree(KUBE_DIR / "etcd-data", ignore_errors=True)


def token_for(api: Api, node: str | None) -> str:
    """A token of the driver's account bound to its pod on `node`; None: bound to no object (no node)."""
    bound = ["--bound-object-kind", "Pod", "--bound-object-name", f"driver-on-{node}"] if node else []
    return api.kubectl("create", "token", ACCOUNT, "-n", NAMESPACE, *bound, "--duration", "10m").strip()


def attempts(api: Api, token: str) -> dict[str, tuple[int, str]]:
    """Every write the driver of node A might try on node B's slice (made by the admin), and on its own."""
    a, b = NODES
    api.kubectl("delete", "resourceslice", "--all", "--wait=true")
    api.apply(slice_of("slice-b", b), slice_of("slice-a", a))
    out: dict[str, tuple[int, str]] = {}
    out["create own"] = api.as_token(token, "create", "-f", "-", input=as_yaml(slice_of("own-new", a)))
    out["create b"] = api.as_token(token, "create", "-f", "-", input=as_yaml(slice_of("b-new", b)))
    out["create all nodes"] = api.as_token(token, "create", "-f", "-", input=as_yaml(slice_of("all", None)))
    b_grown = slice_of("slice-b", b, devices=2)
    b_grown["metadata"]["resourceVersion"] = api.json("resourceslice", "slice-b")["metadata"]["resourceVersion"]
    out["update b"] = api.as_token(token, "replace", "-f", "-", input=as_yaml(b_grown))
    a_grown = slice_of("slice-a", a, devices=2)
    a_grown["metadata"]["resourceVersion"] = api.json("resourceslice", "slice-a")["metadata"]["resourceVersion"]
    out["update own"] = api.as_token(token, "replace", "-f", "-", input=as_yaml(a_grown))
    out["delete b"] = api.as_token(token, "delete", "resourceslice", "slice-b")
    out["delete own"] = api.as_token(token, "delete", "resourceslice", "slice-a")
    return out


def test_the_driver_of_one_node_cannot_write_another_nodes_slices(api: Api) -> None:
    token = token_for(api, NODES[0])
    review = api.as_token(token, "auth", "whoami", "-o", "json")
    assert review[0] == 0 and f'"{NODES[0]}"' in review[1] and "authentication.kubernetes.io/node-name" in review[1], \
        review  # the gate is on: the token carries its pod's node
    before = attempts(api, token)  # RBAC alone: everything goes through (the finding)
    assert all(code == 0 for code, _ in before.values()), before
    api.kubectl("apply", "-f", str(DRA / "admission.yaml"))

    def enforced() -> bool:  # the policy reaches the admission chain a moment after it is stored
        code, _ = api.as_token(token, "create", "--dry-run=server", "-f", "-", input=as_yaml(slice_of("x", NODES[1])))
        return code != 0

    until(enforced, 30, "the admission policy to be enforced", every=0.5)
    after = attempts(api, token)
    for what in ("create own", "update own", "delete own"):
        assert after[what][0] == 0, (what, after[what])
    for what, words in (("create b", f"may not write a ResourceSlice of node '{NODES[1]}'"),
                        ("create all nodes", "may not write a ResourceSlice of no single node"),
                        ("update b", f"may not write a ResourceSlice of node '{NODES[1]}'"),
                        ("delete b", f"may not delete a ResourceSlice of node '{NODES[1]}'")):
        code, text = after[what]
        assert code != 0 and "devinject-dra-node-slices" in text and words in text, (what, text)
    assert api.json("resourceslice", "slice-b")["spec"]["devices"] == [{"name": "gpu-0"}]  # untouched


def test_a_slice_cannot_be_moved_onto_the_drivers_node_nor_written_by_a_token_of_no_node(api: Api) -> None:
    api.kubectl("apply", "-f", str(DRA / "admission.yaml"))
    a, b = NODES
    api.kubectl("delete", "resourceslice", "--all", "--wait=true")
    api.apply(slice_of("slice-b", b))
    token = token_for(api, a)
    taken = slice_of("slice-b", a)  # node B's slice, renamed to node A (nodeName is immutable too)
    taken["metadata"]["resourceVersion"] = api.json("resourceslice", "slice-b")["metadata"]["resourceVersion"]
    code, text = api.as_token(token, "replace", "-f", "-", input=as_yaml(taken))
    assert code != 0, text
    unbound = token_for(api, None)  # the account's token bound to no pod
    code, text = api.as_token(unbound, "create", "-f", "-", input=as_yaml(slice_of("nowhere", a)))
    assert code != 0 and "bound to no node" in text, text
    api.kubectl("delete", "resourceslice", "slice-b")  # the admin is not held to a node
