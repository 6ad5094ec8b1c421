"""Both paths on one node, as plain rules (docs/lifecycle.md, "Both paths on one node"): the ledger's
bookings for the device plugin (nodestate/ledger.py `book_plugin`) against claims' and containers', the
kubelet's checkpoint read (deviceplugin/bookings.py), the plugin's bookings learning and losing their pods, what
each path leaves out of its offer, and the preferred allocation beside a DRA driver. Over real sockets, both
agents together: tests/integration/test_both_paths.py; on the real cluster: tests/e2e/test_both_paths_live.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from devinject.core.errors import LedgerError
from devinject.deviceplugin.allocation import AllocationError, PluginDevice, preferred
from devinject.deviceplugin.bookings import PluginBookings, checkpoint_devices, held_by_claims, read_checkpoint
from devinject.discovery.topology import Place
from devinject.nodestate.ledger import Claim, Ledger, claim_bookings, ledger_problem

POLICY = {"nvidia.com/gpu": "exclusive", "nvidia.com/rdma": "shared"}
GPU0, GPU1 = "c 195:0", "c 195:1"
CLAIM = "dra-claim:dra.devinject.io:1111"
POD, OTHER = "6f1c2d3e-0000-4000-8000-00000000000a", "6f1c2d3e-0000-4000-8000-00000000000b"
RESOURCE = "nvidia.com/gpu"


def gpu(n: int) -> Claim:
    return Claim(f"nvidia.com/gpu={n}", (f"c 195:{n}",))


def device(device_id: str, n: int, *, nodes: tuple[str, ...] | None = None,
           shared: tuple[str, ...] = ()) -> PluginDevice:
    return PluginDevice(device_id, f"nvidia.com/gpu={n}", True, Place(device_id, ("pci0000:00", device_id), 0, ""),
                        nodes if nodes is not None else (f"c 195:{n}",), shared)


def bookings(state: Path) -> dict[str, dict[str, object]]:
    return json.loads((state / "ledger.json").read_text())["allocations"]  # type: ignore[no-any-return]


def test_a_plugin_booking_and_a_claim_refuse_each_other(tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path))
    ledger.book(CLAIM, 1, (gpu(0),), POLICY, for_pods=(POD,))
    with pytest.raises(LedgerError, match=f"device {GPU0} is held by container {CLAIM}"):
        ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0), "0000:2a:00.0": gpu(1)}, policy=POLICY)
    assert not [b for b in bookings(tmp_path) if b.startswith("device-plugin:")]  # all or nothing
    assert ledger.book_plugin(RESOURCE, {"0000:2a:00.0": gpu(1)}, policy=POLICY) == ["0000:2a:00.0"]
    entry = bookings(tmp_path)["device-plugin:nvidia.com/gpu:0000:2a:00.0"]
    assert (entry["plugin"], entry["exclusive"], entry["pods"], entry["pid"]) == (RESOURCE, [GPU1], [], 1)
    with pytest.raises(LedgerError, match="held by the device plugin: nvidia.com/gpu device 0000:2a:00.0, pod not"):
        ledger.book("dra-claim:dra.devinject.io:2222", 1, (gpu(1),), POLICY, for_pods=(OTHER,))
    # a pod's claim does not make the plugin's device of the same pod its own: one GPU, two paths
    ledger.plugin_update({"device-plugin:nvidia.com/gpu:0000:2a:00.0": [POD]})
    with pytest.raises(LedgerError, match=f"pod {POD}"):
        ledger.book("dra-claim:dra.devinject.io:3333", 1, (gpu(1),), POLICY, for_pods=(POD,))


def test_containers_and_the_plugins_bookings_never_clash(tmp_path: Path) -> None:
    """The hook books a device-plugin pod's container on the device the plugin booked for it (its pod is not
    known to the booking yet, or at all): no clash either way, as before the plugin booked anything."""
    ledger = Ledger(str(tmp_path))
    ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0)}, policy=POLICY)
    assert ledger.book("container-a", os.getpid(), (gpu(0),), POLICY).new
    ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0)}, policy=POLICY)  # and a container there first
    ledger.book("container-b", os.getpid(), (gpu(1),), POLICY)
    ledger.book_plugin(RESOURCE, {"0000:2a:00.0": gpu(1)}, policy=POLICY)


def test_the_kubelet_giving_a_device_again_replaces_the_plugins_booking(tmp_path: Path) -> None:
    """The kubelet frees a device in its own accounting before the old pod's directory is gone: a new
    Allocate of it is the kubelet's word, not a clash with the plugin's own booking."""
    ledger = Ledger(str(tmp_path))
    ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0)}, policy=POLICY)
    ledger.plugin_update({"device-plugin:nvidia.com/gpu:0000:18:00.0": [POD]})
    assert ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0)}, policy=POLICY) == ["0000:18:00.0"]
    assert bookings(tmp_path)["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == []
    # a rebook from the checkpoint of a booking there already only learns its pod
    assert ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0)}, pods={"0000:18:00.0": [OTHER]},
                              policy=POLICY) == []
    assert bookings(tmp_path)["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == [OTHER]


def test_a_shared_kind_and_an_unhealthy_device(tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path))
    nic = Claim("nvidia.com/rdma=0", ("c 231:0",))
    ledger.book("dra-claim:dra.devinject.io:4444", 1, (nic,), POLICY, for_pods=(POD,))
    ledger.book_plugin("nvidia.com/rdma", {"0000:19:00.0": nic}, policy=POLICY)  # RDMA is shared
    (tmp_path / "health.json").write_text(json.dumps({"unhealthy_nodes": [GPU1]}))
    with pytest.raises(LedgerError, match="unhealthy"):
        ledger.book_plugin(RESOURCE, {"0000:2a:00.0": gpu(1)}, policy=POLICY)


def test_the_plugins_bookings_are_kept_beside_the_ledger_for_a_rebuild(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from devinject.nodestate import evidence

    monkeypatch.setattr(evidence, "collect", lambda proc="/proc": [])  # no container runs: evidence is empty
    ledger = Ledger(str(tmp_path))
    ledger.book_plugin(RESOURCE, {"0000:18:00.0": gpu(0)}, policy=POLICY)
    ledger.plugin_update({"device-plugin:nvidia.com/gpu:0000:18:00.0": [POD]})
    assert list(claim_bookings(ledger.read() or {})) == ["device-plugin:nvidia.com/gpu:0000:18:00.0"]
    (tmp_path / "ledger.json").write_text("{broken")
    with pytest.raises(LedgerError, match="held by the device plugin"):
        Ledger(str(tmp_path)).book(CLAIM, 1, (gpu(0),), POLICY, for_pods=(OTHER,))
    assert bookings(tmp_path)["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == [POD]
    # released, it is gone from the copy too: a later rebuild does not bring it back
    Ledger(str(tmp_path)).plugin_update({}, ["device-plugin:nvidia.com/gpu:0000:18:00.0"])
    (tmp_path / "ledger.json").write_text("{broken")
    assert Ledger(str(tmp_path)).book(CLAIM, 1, (gpu(0),), POLICY, for_pods=(OTHER,)).new


def test_the_plugin_field_is_validated() -> None:
    entry = {"devices": [], "exclusive": [GPU0], "shared": [], "pid": 1, "start_time": 1, "state": "active",
             "pods": []}
    assert ledger_problem({"allocations": {"a": {**entry, "plugin": RESOURCE}}}) is None
    assert ledger_problem({"allocations": {"a": {**entry, "plugin": 7}}}) == "allocation a: plugin is not a string"


def test_the_kubelets_checkpoint_in_both_of_its_forms(tmp_path: Path) -> None:
    v2 = {"Data": {"PodDeviceEntries": [
        {"PodUID": POD, "ContainerName": "a", "ResourceName": RESOURCE, "DeviceIDs": {"0": ["0000:18:00.0"],
                                                                                       "1": ["0000:db:00.0"]}},
        {"PodUID": POD, "ContainerName": "b", "ResourceName": RESOURCE, "DeviceIDs": {"-1": ["0000:2a:00.0"]}},
        {"PodUID": OTHER, "ContainerName": "a", "ResourceName": "nvidia.com/rdma", "DeviceIDs": {"0": ["x"]}},
        {"PodUID": 5, "ResourceName": RESOURCE, "DeviceIDs": {"0": ["y"]}}, "junk"],
        "RegisteredDevices": {}}, "Checksum": 1}
    assert checkpoint_devices(json.dumps(v2)) == {
        (RESOURCE, "0000:18:00.0"): {POD}, (RESOURCE, "0000:db:00.0"): {POD}, (RESOURCE, "0000:2a:00.0"): {POD},
        ("nvidia.com/rdma", "x"): {OTHER}}
    v1 = {"Data": {"PodDeviceEntries": [{"PodUID": OTHER, "ContainerName": "a", "ResourceName": RESOURCE,
                                          "DeviceIDs": ["0000:18:00.0"]}]}}
    assert checkpoint_devices(json.dumps(v1)) == {(RESOURCE, "0000:18:00.0"): {OTHER}}
    with pytest.raises(ValueError, match="not a kubelet device-manager checkpoint"):
        checkpoint_devices('{"Data": {}}')
    path = tmp_path / "kubelet_internal_checkpoint"
    assert read_checkpoint(str(path)) is None
    path.write_text("{half")
    assert read_checkpoint(str(path)) is None


class PluginNode:
    def __init__(self, tmp: Path, *, pods_dir: bool = True, grace: float = 30.0) -> None:
        self.state, self.plugins, self.pods = tmp / "state", tmp / "device-plugins", tmp / "pods"
        for directory in (self.state, self.plugins) + ((self.pods,) if pods_dir else ()):
            directory.mkdir()
        self.bookings = PluginBookings(str(self.state), str(self.plugins), str(self.pods), grace=grace)
        self.devices = {"0000:18:00.0": device("0000:18:00.0", 0), "0000:2a:00.0": device("0000:2a:00.0", 1)}

    def checkpoint(self, given: dict[str, list[str]]) -> None:
        entries = [{"PodUID": p, "ContainerName": "c", "ResourceName": RESOURCE, "DeviceIDs": {"0": ids}}
                   for p, ids in given.items()]
        (self.plugins / "kubelet_internal_checkpoint").write_text(json.dumps({"Data": {"PodDeviceEntries": entries}}))

    def round(self) -> dict[str, dict[str, object]]:
        self.bookings.reconcile({RESOURCE: self.devices})
        return {b: e for b, e in bookings(self.state).items() if b.startswith("device-plugin:")}


def test_a_booking_learns_its_pod_and_ends_with_the_pods_directory(tmp_path: Path) -> None:
    node = PluginNode(tmp_path)
    node.bookings.book(RESOURCE, [node.devices["0000:18:00.0"]])
    assert node.round()["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == []  # checkpoint not written yet
    node.checkpoint({POD: ["0000:18:00.0"]})
    assert node.round()["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == []  # its directory not made yet
    (node.pods / POD).mkdir()
    assert node.round()["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == [POD]
    (node.pods / POD).rmdir()  # the kubelet removes it once the pod's containers have ended
    assert node.round() == {}  # the checkpoint still names it (the kubelet rewrites it at its next allocation)


def test_a_booking_no_pod_took_ends_after_the_grace(tmp_path: Path) -> None:
    node = PluginNode(tmp_path, grace=0.3)
    node.bookings.book(RESOURCE, [node.devices["0000:2a:00.0"]])
    assert node.round()
    time.sleep(0.4)
    assert node.round() == {}


def test_without_the_pods_directories_a_booking_ends_when_the_checkpoint_forgets_it(tmp_path: Path) -> None:
    node = PluginNode(tmp_path, pods_dir=False, grace=0.3)
    node.bookings.book(RESOURCE, [node.devices["0000:18:00.0"]])
    node.checkpoint({POD: ["0000:18:00.0"]})
    assert node.round()["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == [POD]
    time.sleep(0.4)
    assert node.round()  # past the grace, but the kubelet still gives it to a pod
    node.checkpoint({})
    assert node.round() == {}


def test_a_lost_booking_is_booked_again_from_the_checkpoint_for_a_pod_that_exists(tmp_path: Path) -> None:
    node = PluginNode(tmp_path)
    node.checkpoint({POD: ["0000:18:00.0"], OTHER: ["0000:2a:00.0"]})  # OTHER's pod is gone: a stale entry
    (node.pods / POD).mkdir()
    assert {b: e["pods"] for b, e in node.round().items()} == {"device-plugin:nvidia.com/gpu:0000:18:00.0": [POD]}
    with pytest.raises(LedgerError, match="held by the device plugin"):
        Ledger(str(node.state)).book(CLAIM, 1, (gpu(0),), POLICY, for_pods=(OTHER,))


def test_allocate_is_refused_what_a_claim_holds_and_the_offer_says_so(tmp_path: Path) -> None:
    node = PluginNode(tmp_path)
    Ledger(str(node.state)).book(CLAIM, 1, (gpu(1),), POLICY, for_pods=(POD,))
    with pytest.raises(AllocationError, match=f"held by container {CLAIM}"):
        node.bookings.book(RESOURCE, [node.devices["0000:2a:00.0"]])
    assert held_by_claims(node.bookings.read(), node.devices) == {"0000:2a:00.0": f"held by DRA claim {CLAIM}"}
    # a MIG instance's claim holds its parent GPU's node shared: the whole GPU is held, a sibling is not
    Ledger(str(node.state)).book("dra-claim:dra.devinject.io:5555", 1, (
        Claim("nvidia.com/gpu=0:1", ("c 195:7", "c 511:10"), ("c 195:7",)),), POLICY, for_pods=(OTHER,))
    whole = device("0000:07:00.0", 7, nodes=("c 195:7",))
    sibling = device("0000:07:00.0-gi2-ci0", 7, nodes=("c 195:7", "c 511:20"), shared=("c 195:7",))
    held = held_by_claims(node.bookings.read(), {"whole": whole, "sibling": sibling})
    assert list(held) == ["whole"]


def test_the_preferred_allocation_avoids_held_devices_and_beside_dra_picks_from_the_top() -> None:
    devices = {f"0000:0{n}:00.0": device(f"0000:0{n}:00.0", n) for n in range(1, 5)}
    everything = sorted(devices)
    assert preferred(devices, everything, [], 1) == ["0000:01:00.0"]
    assert preferred(devices, everything, [], 1, from_top=True) == ["0000:04:00.0"]
    assert preferred(devices, everything, [], 2, {"0000:01:00.0"}) == ["0000:02:00.0", "0000:03:00.0"]
    # not enough without the held ones: the kubelet's request is answered, and Allocate decides
    assert len(preferred(devices, everything, [], 4, {"0000:01:00.0"})) == 4
