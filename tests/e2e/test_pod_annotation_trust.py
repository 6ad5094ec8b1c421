"""A pod user names GPUs to the hook (under real runc): with containerd's `pod_annotations = ["cdi.k8s.io/*"]`
a pod's own annotation reaches the OCI config as if the kubelet had set it. In a container whose cgroup names
a pod, the hook serves only what the node's agents handed out for that pod: the device plugin's grant, whose
token the kubelet puts in the container's env, bound to the first pod presenting it. Before, the annotation
`nvidia.com/gpu=all` got every GPU mounted, granted in the device cgroup and booked exclusive.

The pod cgroups are the kubelet's systemd layout, given to runc as its cgroups path (as in
test_dra_pod_hook_live.py)."""

from __future__ import annotations

import pytest

from devinject.nodestate.grants import grant_env_key, write_grant
from devinject.nodestate.ledger import Ledger
from tests.e2e.conftest import Bundle, container_name
from tests.e2e.test_dra_pod_hook_live import pod_cgroup, pod_cgroups  # noqa: F401 (the fixture, used by name)
from tests.unit.test_ledger_pods import OTHER_POD, POD

pytestmark = pytest.mark.live

RESOURCE = "nvidia.com/gpu"
HOSTILE = {"cdi.k8s.io/x": "nvidia.com/gpu=all"}  # the pod user's own annotation, passed through
OPEN = "cat /dev/nvidia0; echo finished"  # the fixture host has one GPU


def run_in(bundle: Bundle, pod: str | None, annotations: dict[str, str], env: list[str] | None = None) \
        -> tuple[str, int, str]:
    name = container_name()
    if pod is None:
        bundle.config["linux"].pop("cgroupsPath", None)
    else:
        bundle.config["linux"]["cgroupsPath"] = pod_cgroup(pod, name)
    bundle.save(["sh", "-c", OPEN], annotations=annotations, env=env)
    done = bundle.run(name)
    return name, done.returncode, done.stdout + done.stderr


def record_of(bundle: Bundle, name: str) -> dict[str, object]:
    found = [r for r in bundle.log_records() if r.get("container") == name and r.get("stage") != "poststop"]
    assert len(found) == 1, bundle.log_records()
    return found[0]


@pytest.mark.usefixtures("pod_cgroups")
def test_a_pod_annotation_gets_a_pod_no_gpu(bundle: Bundle) -> None:
    name, code, out = run_in(bundle, POD, HOSTILE)
    assert code == 0, out
    # no node was made: the image's /dev has none (before: ENXIO, the node made and granted)
    assert "can't open '/dev/nvidia0': No such file or directory" in out and "finished" in out, out
    record = record_of(bundle, name)
    assert record["devices"] == [] and record["pod"] == POD, record
    assert "nvidia.com/gpu=all" in str(record["untrusted"]), record
    assert Ledger(str(bundle.state_dir)).snapshot()["allocations"] == {}


@pytest.mark.usefixtures("pod_cgroups")
def test_a_grant_gives_its_pod_what_the_plugin_allocated_and_no_other_pod_anything(bundle: Bundle) -> None:
    bundle.state_dir.mkdir(mode=0o755, exist_ok=True)
    token = write_grant(str(bundle.state_dir), RESOURCE, ("nvidia.com/gpu=0",))
    kubelet = {"cdi.k8s.io/devinject_nvidia.com_gpu": "nvidia.com/gpu=0", **HOSTILE}
    env = [f"{grant_env_key(RESOURCE)}={token}"]
    for _ in range(2):  # the container restarted: the grant is its pod's still
        name, code, out = run_in(bundle, POD, kubelet, env)
        assert code == 0, out
        assert "can't open '/dev/nvidia0': No such device or address" in out, out  # made and granted
        record = record_of(bundle, name)
        assert record["devices"] == ["nvidia.com/gpu=0"] and record["source"] == "grant", record
        assert "nvidia.com/gpu=all" in str(record["untrusted"]), record  # the pod's own word: ignored
    name, code, out = run_in(bundle, OTHER_POD, kubelet, env)  # a pod that read the token from another
    assert code == 0 and "can't open '/dev/nvidia0': No such file or directory" in out, out
    assert "bound to another pod" in str(record_of(bundle, name)["untrusted"])


def test_outside_pods_annotations_stay_the_admins(bundle: Bundle) -> None:
    name, code, out = run_in(bundle, None, HOSTILE)  # root made this container: its annotations are root's
    assert code == 0, out
    assert "can't open '/dev/nvidia0': No such device or address" in out, out
    assert record_of(bundle, name)["devices"] == ["nvidia.com/gpu=all"]
