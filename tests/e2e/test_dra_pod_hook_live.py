"""The OCI hook under real runc in a DRA claim's own pod (issue 21, direction two): on a node where the hook
is installed for every container (CRI-O's hooks.d, an admin's `cdi.k8s.io` annotation), a container of the
pod a claim is reserved for asks for the claim's GPU. The claim's booking (the driver's: pid 1, `pods`) is no
clash with it, because the container's cgroup, which runc made as the kubelet asks, names that pod; a
container of no pod is refused as before, and one of another pod gets nothing (the claim is not its pod's,
so its annotation is ignored: tests/e2e/test_pod_annotation_trust.py). Before, the claim refused its own pod.

The pod cgroups are the kubelet's systemd layout (`/kubepods.slice/...`), given to runc as its cgroups path:
a kubelet running on this machine (cgroupfs driver) leaves that tree alone."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

import pytest

from devinject.hook.plan import node_identity
from devinject.hook.registry import Registry
from devinject.nodestate.ledger import Claim, Ledger
from tests.e2e.conftest import Bundle, container_name
from tests.unit.test_ledger_pods import OTHER_POD, POD

pytestmark = pytest.mark.live

GPU = "nvidia.com/gpu=0"
CLAIM = "dra-claim:dra.devinject.io:0b7f8e7c-3333-4c1b-9a55-000000000001"


@pytest.fixture
def pod_cgroups() -> Iterator[None]:
    """The pods' cgroups runc leaves behind (it removes a container's own, not its parents), removed from
    every hierarchy after the test, deepest first; only what is empty."""
    yield
    for pod in (POD, OTHER_POD):
        for directory in sorted(glob.glob(f"/sys/fs/cgroup/*{pod_cgroup(pod, '*').rsplit('/', 1)[0]}"), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    for parent in ("/kubepods.slice/kubepods-besteffort.slice", "/kubepods.slice"):
        for directory in glob.glob(f"/sys/fs/cgroup/*{parent}"):
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def pod_cgroup(pod: str, name: str) -> str:
    escaped = pod.replace("-", "_")
    return (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{escaped}.slice/"
            f"cri-containerd-{name}.scope")


def claim_booked_for(bundle: Bundle, pod: str) -> str:
    """The driver's booking of a claim for GPU 0, reserved for `pod` (as dra/claims.py books it); its node."""
    (_, edits), = Registry((str(bundle.spec_dir),)).resolve((GPU,)).devices
    nodes = tuple(node_identity(n) for n in edits.device_nodes)
    bundle.state_dir.mkdir(mode=0o755, exist_ok=True)
    Ledger(str(bundle.state_dir)).book(CLAIM, 1, (Claim(GPU, nodes),), {"nvidia.com/gpu": "exclusive"},
                                       for_pods=(pod,))
    return nodes[0]


def run_in(bundle: Bundle, pod: str | None) -> tuple[str, int, str]:
    """A container (in `pod`'s cgroup, or in none) asking the hook for GPU 0 and opening its node: the
    fixture's node has no driver behind it, so a container the device cgroup lets through gets ENXIO."""
    name = container_name()
    if pod is None:
        bundle.config["linux"].pop("cgroupsPath", None)
    else:
        bundle.config["linux"]["cgroupsPath"] = pod_cgroup(pod, name)
    bundle.save(["sh", "-c", "cat /dev/nvidia0; echo finished"], annotations={"cdi.k8s.io/test": GPU})
    done = bundle.run(name)
    return name, done.returncode, done.stdout + done.stderr


def test_the_claims_own_pod_gets_its_gpu_and_no_other_container_does(bundle: Bundle, pod_cgroups: None) -> None:
    node = claim_booked_for(bundle, POD)
    name, code, out = run_in(bundle, POD)
    assert code == 0, out
    assert "can't open '/dev/nvidia0': No such device or address" in out and "finished" in out, out
    served = [r for r in bundle.log_records() if r.get("container") == name and r.get("stage") != "poststop"]
    assert len(served) == 1 and not served[0].get("error") and GPU in str(served[0]), served
    # another pod's container: the claim is no grant of its pod, so its annotation is ignored (no node made)
    other, code, out = run_in(bundle, OTHER_POD)
    assert code == 0 and "can't open '/dev/nvidia0': No such file or directory" in out, out
    assert [r.get("devices") for r in bundle.log_records() if r.get("container") == other] == [[]]
    _, code, stderr = run_in(bundle, None)  # a container of no pod: its annotation is root's, and refused
    assert code != 0 and f"device {node} is held by container {CLAIM}" in stderr, stderr
    assert sorted(Ledger(str(bundle.state_dir)).snapshot()["allocations"]) == [CLAIM]  # runs done, released
