"""Claims reserved for a PodGroup (DRAWorkloadResourceClaims: alpha in 1.36, beta and off in 1.37): the claim's
`status.reservedFor` names the group (`scheduling.k8s.io` `podgroups`), not its pods, and every pod of the
group (`spec.schedulingGroup.podGroupName`) shares it. The driver books such a claim for the group's pods on
this node, as it books a claim for the pods it names: their containers share its devices, a rebuilt ledger
keeps the claim over them, and it is held until unprepared. Before, only `pods` entries counted: the claim was
booked for no pod, so after a ledger rebuild its booking was refused over its own pods' containers and its
devices were held by nobody the ledger knew of."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devinject.core.errors import LedgerError
from devinject.dra.claims import ClaimReadError, group_members, reserved_groups, reserved_pods
from devinject.dra.driver import DraDriver
from devinject.dra.kubeapi import credentials
from devinject.dra.publisher import SlicePublisher
from devinject.nodestate.ledger import Claim, Ledger
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver
from tests.unit.test_dra_claims import BOOKING, GPU_NODE, UID, consumer, corrupt_ledger, dirs, pod_container
from tests.unit.test_kubeapi import Recorder, certs, kubeconfig, server
from tests.unit.test_ledger_pods import OTHER_POD, POD

__all__ = ["certs", "dirs", "server"]  # test_dra_claims' and test_kubeapi's fixtures

GROUP = "trainers"
GROUP_REF = {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": GROUP,
             "uid": "0b7f8e7c-9999-4c1b-9a55-000000000001"}


def pod(uid: str, group: str | None, node: str = "node1") -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node}
    if group is not None:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {"metadata": {"uid": uid, "name": f"p-{uid[:4]}"}, "spec": spec}


class GroupApi(FakeApi):
    """The API server with PodGroups: the pods on this node (a list, as the API answers it)."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: list[dict[str, Any]] = []
        self.lists: list[tuple[str, str]] = []
        self.failing = False

    def group_pods(self, namespace: str, group: str) -> tuple[str, ...]:
        self.lists.append((namespace, group))
        if self.failing:
            raise ClaimReadError(f"list pods of podgroup {namespace}/{group} on node1: 503 ServiceUnavailable", 503)
        return group_members({"items": self.pods}, group)


@pytest.fixture
def api() -> GroupApi:
    """One claim for the GPU at 0000:2a:00.0, reserved for the PodGroup, whose pod POD runs on this node."""
    api = GroupApi()
    api.add("held", UID, [(GPU_POOL, "gpu-0000-2a-00-0")])
    api.claims[("default", "held")]["status"]["reservedFor"] = [GROUP_REF]
    api.pods = [pod(POD, GROUP), pod(OTHER_POD, None)]
    return api


@pytest.fixture
def driver(dirs: dict[str, str], api: GroupApi) -> Iterator[DraDriver]:
    yield make_driver(dirs, api)


def test_reserved_groups_are_the_podgroup_consumers_of_the_claim() -> None:
    claim = {"status": {"reservedFor": [GROUP_REF, dict(GROUP_REF), consumer(POD),
                                        {**GROUP_REF, "apiGroup": "example.com"},
                                        {**GROUP_REF, "resource": "workloads"}, {**GROUP_REF, "name": ""},
                                        {**GROUP_REF, "name": 7}, "garbage"]}}
    assert reserved_groups(claim) == (GROUP,)
    assert reserved_pods(claim) == (POD,)  # the group is no pod
    assert reserved_groups({"status": {}}) == () and reserved_groups({}) == ()
    assert reserved_groups({"status": {"reservedFor": "podgroups"}}) == ()


def test_group_members_are_the_pods_whose_scheduling_group_names_it() -> None:
    pods = {"items": [pod(POD, GROUP), pod(OTHER_POD, "others"), pod("c", None), pod("d", GROUP),
                      {"metadata": {"uid": ""}, "spec": {"schedulingGroup": {"podGroupName": GROUP}}},
                      {"metadata": "x", "spec": {"schedulingGroup": {"podGroupName": GROUP}}}, "garbage",
                      {"metadata": {"uid": "e"}, "spec": {"schedulingGroup": GROUP}}]}
    assert group_members(pods, GROUP) == tuple(sorted((POD, "d")))
    assert group_members({"items": None}, GROUP) == () and group_members([], GROUP) == ()


def test_a_podgroup_claim_is_booked_and_checkpointed_for_the_groups_pods(driver: DraDriver, dirs: dict[str, str],
                                                                         api: GroupApi) -> None:
    driver.preparer.prepare("default", "held", UID)
    assert api.lists == [("default", GROUP)]
    assert driver.preparer.prepared()[UID].pods == (POD,)
    booking = Ledger(dirs["state"]).snapshot()["allocations"][BOOKING]
    assert booking["pods"] == [POD] and booking["exclusive"] == [GPU_NODE]


def test_a_pod_reserved_claim_lists_no_pods(driver: DraDriver, api: GroupApi) -> None:
    """The prepare's hot path is unchanged for a claim no PodGroup holds: no list of pods is asked."""
    api.claims[("default", "held")]["status"]["reservedFor"] = [consumer(POD)]
    driver.preparer.prepare("default", "held", UID)
    assert api.lists == [] and driver.preparer.prepared()[UID].pods == (POD,)


def test_the_claim_is_booked_again_over_its_groups_recovered_container(driver: DraDriver, dirs: dict[str, str],
                                                                       v1_device_cgroup: Path) -> None:
    """Prepared; the ledger and the claims' copy lost; rebuilt from live evidence, the group's pod's
    container holds the GPU: the driver's round books the claim over it (before: refused, "its devices are
    not in the ledger"), and once that container is gone the claim alone keeps the GPU from a process in no
    pod, until it is unprepared."""
    driver.preparer.prepare("default", "held", UID)
    with pod_container(v1_device_cgroup, POD):
        corrupt_ledger(dirs)
        assert driver.preparer.rebook() == 0
        assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING]["pods"] == [POD]
    with pytest.raises(LedgerError, match=f"device {GPU_NODE} is held by container {BOOKING}"):
        Ledger(dirs["state"]).book("intruder", os.getpid(), (Claim("nvidia.com/gpu=1", (GPU_NODE,)),))
    driver.preparer.unprepare(UID)
    assert BOOKING not in Ledger(dirs["state"]).snapshot()["allocations"]


def test_a_pod_that_joined_the_group_after_the_prepare_is_learned_when_refused(
        driver: DraDriver, dirs: dict[str, str], api: GroupApi, v1_device_cgroup: Path) -> None:
    """The kubelet prepares a claim once however many of the group's pods come to the node: a pod that joined
    later is not in the booking, and its container in a rebuilt ledger refuses it; the claim is read again
    with its group's pods and booked for both."""
    driver.preparer.prepare("default", "held", UID)
    api.pods.append(pod(OTHER_POD, GROUP))
    with pod_container(v1_device_cgroup, OTHER_POD):
        corrupt_ledger(dirs)
        assert driver.preparer.rebook() == 0
        assert Ledger(dirs["state"]).snapshot()["allocations"][BOOKING]["pods"] == sorted((POD, OTHER_POD))
        assert driver.preparer.prepared()[UID].pods == tuple(sorted((POD, OTHER_POD)))


def test_a_container_of_a_pod_outside_the_group_still_keeps_the_claim_out(
        driver: DraDriver, dirs: dict[str, str], v1_device_cgroup: Path) -> None:
    driver.preparer.prepare("default", "held", UID)
    with pod_container(v1_device_cgroup, OTHER_POD):
        corrupt_ledger(dirs)
        assert driver.preparer.rebook() == 1
        assert BOOKING not in Ledger(dirs["state"]).snapshot()["allocations"]


def test_a_failed_list_of_the_groups_pods_is_logged_and_the_claim_still_prepared(
        driver: DraDriver, api: GroupApi, caplog: pytest.LogCaptureFixture) -> None:
    """The list is the claim's second read, not its allocation: the claim is prepared and held (for no pod
    yet), the failure logged with the group; a booking refused later asks again."""
    api.failing = True
    with caplog.at_level(logging.WARNING, logger="devinject.dra.claims"):
        devices = driver.preparer.prepare("default", "held", UID)
    assert [d.device for d in devices] == ["gpu-0000-2a-00-0"]
    assert driver.preparer.prepared()[UID].pods == ()
    assert f"claim default/held: cannot list the pods of its PodGroup {GROUP}: list pods of podgroup" \
        in caplog.text


def test_the_groups_pods_are_one_list_of_the_namespaces_pods_on_this_node(tmp_path: Path, server: int,
                                                                         certs: Path) -> None:
    """What the API server is asked (a namespace's pods on this node, one bounded page; RBAC: `list pods`)
    and what a refusal is: the claim's read error naming the group and the node."""
    config = kubeconfig(tmp_path / "kc", server, certs / "server.crt", token="t")
    publisher = SlicePublisher(credentials(str(config)), "dra.devinject.io", "node1")
    Recorder.answers[("GET", "/api/v1/namespaces/ml/pods")] = (200, {"items": [pod(POD, GROUP), pod(OTHER_POD, "x")]})
    assert publisher.group_pods("ml", GROUP) == (POD,)
    assert [(s["method"], s["path"]) for s in Recorder.seen] == [
        ("GET", "/api/v1/namespaces/ml/pods?fieldSelector=spec.nodeName%3Dnode1&limit=500")]
    Recorder.answers[("GET", "/api/v1/namespaces/ml/pods")] = (403, {"kind": "Status", "message": "forbidden"})
    with pytest.raises(ClaimReadError, match=f"^list pods of podgroup ml/{GROUP} on node1: .*403 forbidden$"):
        publisher.group_pods("ml", GROUP)
