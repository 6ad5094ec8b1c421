"""A prepared claim's `status.devices` (DRAResourceClaimDeviceStatus, dra/claimstatus.py): the driver's entries,
a Ready condition for each of its devices and an RDMA NIC's network data from sysfs (interface name, hardware
address), written by server-side apply after the kubelet's call was answered and removed at unprepare. Before,
the driver wrote nothing: a GPU+NIC pod's NIC was invisible in the API."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devinject.discovery.host import Host
from devinject.dra.claims import ClaimReadError
from devinject.dra.claimstatus import StatusDevice, StatusWriter, apply_body, device_entries, network_data
from devinject.dra.driver import DraDriver, DraOptions
from devinject.dra.kubeapi import credentials
from devinject.dra.publisher import SlicePublisher
from devinject.specs.generate import GenerateOptions
from tests.conftest import HOSTS
from tests.integration.test_dra_driver import GPU_POOL, NIC_POOL, NODE, FakeApi, prepare, unprepare, wait_for
from tests.unit.test_kubeapi import Recorder, certs, kubeconfig, server

__all__ = ["certs", "server"]  # test_kubeapi's fixtures

DRIVER = "dra.devinject.io"
NIC_FUNCTION = "0000:19:00.0"  # the HGX fixture's ConnectX under the GPU at 18:00.0's switch
MAC = "b8:3f:d2:aa:bb:01"
UID = "0b7f8e7c-5555-4c1b-9a55-000000000001"
GPU, NIC = "gpu-0000-18-00-0", "rdma-0000-19-00-0"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """The HGX host with the NIC's netdev (ib0) as the kernel shows it under the PCI function."""
    root = tmp_path / "host"
    shutil.copytree(HOSTS / "hgx-h100", root, symlinks=True)
    net = Path(Host(str(root)).real(f"/sys/bus/pci/devices/{NIC_FUNCTION}")) / "net" / "ib0"
    net.mkdir(parents=True)
    (net / "address").write_text(MAC + "\n")
    return root


def test_a_nic_has_its_netdev_and_every_device_is_ready(host: Path) -> None:
    devices = [StatusDevice(GPU_POOL, GPU, pci_address="0000:18:00.0"),
               StatusDevice(NIC_POOL, NIC, pci_address=NIC_FUNCTION),
               StatusDevice(GPU_POOL, "gpu-0000-2a-00-0", share_id="b7c5", pci_address="0000:2a:00.0")]
    entries = device_entries(DRIVER, devices, Host(str(host)), "2026-12-06T06:00:00Z", generation=2)
    ready = {"type": "Ready", "status": "True", "reason": "Prepared", "message": f"prepared by {DRIVER} on the node",
             "lastTransitionTime": "2026-12-06T06:00:00Z", "observedGeneration": 2}
    assert entries == [
        {"driver": DRIVER, "pool": GPU_POOL, "device": GPU, "conditions": [ready]},
        {"driver": DRIVER, "pool": NIC_POOL, "device": NIC, "conditions": [ready],
         "networkData": {"interfaceName": "ib0", "hardwareAddress": MAC}},
        {"driver": DRIVER, "pool": GPU_POOL, "device": "gpu-0000-2a-00-0", "conditions": [ready], "shareID": "b7c5"}]
    assert network_data(Host(str(HOSTS / "hgx-h100")), NIC_FUNCTION) is None  # no netdev: no network data
    assert apply_body("ns", "c", UID, []) == {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                              "metadata": {"name": "c", "namespace": "ns", "uid": UID},
                                              "status": {"devices": []}}


def test_a_refused_write_is_logged_and_a_claim_gone_is_not(host: Path, caplog: pytest.LogCaptureFixture) -> None:
    answers: list[ClaimReadError] = [ClaimReadError("apply resourceclaim ns/c status: 403 forbidden", 403),
                                     ClaimReadError("apply resourceclaim ns/c status: 404 not found", 404)]

    def refuse(namespace: str, name: str, body: dict[str, Any]) -> object:
        raise answers.pop(0)

    writer = StatusWriter(DRIVER, lambda: Host(str(host)), refuse)
    with caplog.at_level(logging.WARNING, logger="devinject.dra.claimstatus"):
        assert writer.write("ns", "c", UID, [StatusDevice(GPU_POOL, GPU)]) is False
        assert writer.write("ns", "c", UID, []) is False
    assert caplog.messages == [f"claim ns/c ({UID}): device status not written: apply resourceclaim ns/c status: "
                               "403 forbidden"]


def test_the_apply_is_a_server_side_apply_of_the_status_as_the_driver(tmp_path: Path, server: int,
                                                                      certs: Path) -> None:
    config = kubeconfig(tmp_path / "kc", server, certs / "server.crt", token="t")
    publisher = SlicePublisher(credentials(str(config)), DRIVER, NODE)
    body = apply_body("ns", "c", UID, [])
    publisher.apply_claim_status("ns", "c", body)
    (seen,) = Recorder.seen
    assert (seen["method"], seen["path"], seen["body"]) == (
        "PATCH", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status?fieldManager=dra.devinject.io"
        "&force=true", body)
    assert seen["type"] == "application/apply-patch+yaml"  # JSON is YAML; a merge patch could drop others' entries


class StatusApi(FakeApi):
    """The API server that takes the claims' status applies, as the driver sends them."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[tuple[str, str, dict[str, Any]]] = []

    def apply_claim_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.applied.append((namespace, name, body))
        return {}


@pytest.fixture
def driver(host: Path, tmp_path: Path) -> Iterator[tuple[DraDriver, StatusApi]]:
    api = StatusApi()
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    gen = GenerateOptions(root=str(host), hook_path="/usr/bin/devinject")
    made = DraDriver(DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"],
                                registry_dir=dirs["registry"], cdi_dir=dirs["cdi"], state_dir=dirs["state"],
                                rescan=3600), api)
    made.start()
    made.refresh()
    yield made, api
    made.servers.stop()
    assert made.status is not None
    made.status.close()


def test_a_gpu_and_nic_claim_gets_its_status_after_the_prepare_and_loses_it_at_unprepare(
        driver: tuple[DraDriver, StatusApi]) -> None:
    made, api = driver
    api.add("pair", UID, [(GPU_POOL, GPU), (NIC_POOL, NIC)])
    assert prepare(made, ("pair", UID)).claims[UID].error == ""
    wait_for("the claim's status written", lambda: api.applied)
    ((namespace, name, body),) = api.applied
    assert (namespace, name, body["metadata"]) == ("default", "pair", {"name": "pair", "namespace": "default",
                                                                        "uid": UID})
    entries = {e["device"]: e for e in body["status"]["devices"]}
    assert set(entries) == {GPU, NIC}  # the other driver's result in the claim is not ours to write
    assert entries[NIC]["networkData"] == {"interfaceName": "ib0", "hardwareAddress": MAC}
    assert "networkData" not in entries[GPU]
    assert [c["type"] for e in entries.values() for c in e["conditions"]] == ["Ready", "Ready"]
    assert unprepare(made, ("pair", UID)).claims[UID].error == ""
    wait_for("the claim's status removed", lambda: len(api.applied) == 2)
    assert api.applied[1][2]["status"] == {"devices": []}


def test_a_status_write_that_fails_to_queue_never_fails_the_prepare(driver: tuple[DraDriver, StatusApi],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The status is for people and tools: whatever goes wrong with it (here the queue itself) is logged, and
    the kubelet still gets the claim's devices and, later, its unprepare."""
    made, api = driver
    api.add("pair", UID, [(GPU_POOL, GPU), (NIC_POOL, NIC)])
    assert made.status is not None

    def broken(*_: object) -> None:
        raise RuntimeError("queue broken")

    monkeypatch.setattr(made.status, "prepared", broken)
    monkeypatch.setattr(made.servers.dra_service, "unprepared", broken)
    answer = prepare(made, ("pair", UID)).claims[UID]
    assert answer.error == "" and len(answer.devices) == 2
    assert unprepare(made, ("pair", UID)).claims[UID].error == ""
