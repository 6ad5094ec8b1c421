"""The device plugin and the DRA driver on one node, over one ledger (docs/lifecycle.md, "Both paths on one
node"): the plugin's Allocate books what it hands out and is refused what a claim holds; a claim is not
prepared on what the plugin holds; a device held through one path leaves the other path's offer (Unhealthy
in ListAndWatch, out of the ResourceSlice) and comes back when released; the two racing for one device never
both win; the plugin's bookings learn their pods from the kubelet's checkpoint, end with the pods'
directories, and survive a plugin restart, a corrupt ledger and a lost one. Both agents run here on the same
HGX fixture and state directory, the plugin against tests/integration/fake_kubelet.py, the driver's kubelet
side and API server faked as in test_dra_driver.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.dra.driver import DraDriver, DraOptions
from devinject.nodestate.ledger import Ledger
from devinject.specs.generate import GenerateOptions
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, NODE, FakeApi, prepare, unprepare

POD_A = "6f1c2d3e-0000-4000-8000-00000000000a"
POD_B = "6f1c2d3e-0000-4000-8000-00000000000b"
CLAIM = "0b7f8e7c-2222-4c1b-9a55-000000000001"


class Node:
    """One node: the device plugin (fake kubelet), the DRA driver (fake API server), one state dir."""

    def __init__(self, root: Path, tmp: Path, plugin_dir: Path) -> None:
        self.root, self.tmp, self.plugin_dir = root, tmp, plugin_dir
        self.state = tmp / "state"
        self.state.mkdir(mode=0o755, exist_ok=True)
        self.pods = tmp / "pods"
        self.pods.mkdir(exist_ok=True)
        self.kubelet = FakeKubelet(str(plugin_dir))
        self.kubelet.start()
        self.plugin: tuple[DevicePluginAgent, threading.Thread, threading.Event] | None = None
        self.start_plugin()
        self.api = FakeApi()
        gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject")
        dirs = {name: str(tmp / name) for name in ("plugins", "registry", "cdi")}
        self.driver = DraDriver(DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"],
                                           registry_dir=dirs["registry"], cdi_dir=dirs["cdi"],
                                           state_dir=str(self.state), rescan=3600), self.api)
        self.driver.start()
        self.driver.refresh()
        self.stop_follower = threading.Event()
        self.follower = threading.Thread(target=self.driver._follow_ledger, args=(self.stop_follower,), daemon=True)
        self.follower.start()

    def start_plugin(self) -> None:
        gen = GenerateOptions(root=str(self.root), hook_path="/usr/bin/devinject", kinds=("nvidia.com/gpu",))
        watch = WatchOptions(generate=gen, output_dir=self.tmp / "cdi-dp", state_dir=str(self.state), interval=0.1,
                             recheck=0.05, threshold=2, rescan=3600, uevents=False, probe_timeout=1.0)
        agent = DevicePluginAgent(PluginOptions(watch=watch, plugin_dir=str(self.plugin_dir), kubelet_poll=0.2,
                                                pods_dir=str(self.pods), ledger_poll=0.1, pod_grace=2.0))
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        self.plugin = (agent, thread, stop)
        assert self.kubelet.wait_for(lambda: self.kubelet.latest("nvidia.com/gpu")), "the plugin never registered"

    def stop_plugin(self) -> None:
        assert self.plugin is not None
        _, thread, stop = self.plugin
        stop.set()
        thread.join(timeout=10)
        self.plugin = None

    def close(self) -> None:
        self.stop_follower.set()
        self.follower.join(timeout=5)
        self.driver.servers.stop()
        if self.plugin is not None:
            self.stop_plugin()
        self.kubelet.stop()

    # --- the kubelet's side ------------------------------------------------------------------------
    def allocate(self, *ids: str) -> api.AllocateResponse:
        return self.kubelet.plugins["nvidia.com/gpu"].stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=list(ids))]), timeout=5)

    def preferred(self, available: list[str], size: int) -> list[str]:
        answer = self.kubelet.plugins["nvidia.com/gpu"].stub.GetPreferredAllocation(
            api.PreferredAllocationRequest(container_requests=[api.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, allocation_size=size)]), timeout=5)
        return list(answer.container_responses[0].deviceIDs)

    def health(self, device_id: str) -> str:
        return self.kubelet.latest("nvidia.com/gpu")[device_id][0]

    def checkpoint(self, given: dict[str, list[str]]) -> None:
        """The kubelet's checkpoint as its device manager writes it (v2: device IDs per NUMA node)."""
        entries = [{"PodUID": pod, "ContainerName": "c", "ResourceName": "nvidia.com/gpu",
                    "DeviceIDs": {"0": ids}, "AllocResp": ""} for pod, ids in given.items()]
        (self.plugin_dir / "kubelet_internal_checkpoint").write_text(json.dumps(
            {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 0}))

    def pod(self, uid: str, present: bool = True) -> None:
        if present:
            (self.pods / uid).mkdir(exist_ok=True)
        else:
            shutil.rmtree(self.pods / uid, ignore_errors=True)

    # --- the scheduler's side ----------------------------------------------------------------------
    def published(self) -> set[str]:
        return {d["name"] for s in self.api.slices for d in s["spec"].get("devices", [])}

    def bookings(self) -> dict[str, Any]:
        return {cid: e for cid, e in json.loads((self.state / "ledger.json").read_text())["allocations"].items()
                if cid.startswith("device-plugin:")}


def wait(condition, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


@pytest.fixture
def node(host_copy, tmp_path) -> Iterator[Node]:  # type: ignore[no-untyped-def]
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # a socket path has at most 107 bytes
    one = Node(host_copy("hgx-h100"), tmp_path, plugin_dir)
    try:
        yield one
    finally:
        one.close()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def test_a_device_the_plugin_gave_a_pod_leaves_the_slice_and_is_not_prepared_until_its_pod_is_gone(node: Node) -> None:
    assert "gpu-0000-18-00-0" in node.published()
    node.allocate("0000:18:00.0")
    assert node.bookings()["device-plugin:nvidia.com/gpu:0000:18:00.0"]["exclusive"] == ["c 195:2"]
    assert wait(lambda: "gpu-0000-18-00-0" not in node.published()), "still offered to the scheduler"
    assert "gpu-0000-2a-00-0" in node.published()
    # a claim the scheduler allocated on it before the slice changed: refused, with who holds it, nothing left
    node.api.add("late", CLAIM, [(GPU_POOL, "gpu-0000-18-00-0")])
    answer = prepare(node.driver, ("late", CLAIM)).claims[CLAIM]
    assert "held by the device plugin: nvidia.com/gpu device 0000:18:00.0" in answer.error and not answer.devices
    assert not [f for f in os.listdir(node.tmp / "cdi") if f.startswith(DRIVER)]
    # the kubelet's checkpoint names the pod, whose directory exists: the booking learns it
    node.checkpoint({POD_A: ["0000:18:00.0"]})
    node.pod(POD_A)
    assert wait(lambda: node.bookings()["device-plugin:nvidia.com/gpu:0000:18:00.0"]["pods"] == [POD_A])
    time.sleep(2.5)  # past the grace for a booking with no pod: a pod that exists keeps it
    assert "device-plugin:nvidia.com/gpu:0000:18:00.0" in node.bookings()
    # the pod is gone (its directory removed; the checkpoint still lists it, as the kubelet's does until its
    # next allocation): released, back in the slice, and the kubelet's retry of the claim is prepared
    node.pod(POD_A, present=False)
    assert wait(lambda: not node.bookings()), "the booking outlived its pod"
    assert wait(lambda: "gpu-0000-18-00-0" in node.published()), "not offered again"
    answer = prepare(node.driver, ("late", CLAIM)).claims[CLAIM]
    assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-0000-18-00-0"]


def _taints(node: Node, name: str) -> list[dict[str, Any]] | None:
    """The taints of device `name` in the slices, None when it is not in them."""
    found = [d for s in node.api.slices for d in s["spec"].get("devices", []) if d["name"] == name]
    return found[0].get("taints", []) if found else None


def test_a_claim_allocated_on_a_device_the_plugin_holds_keeps_it_tainted_no_execute_until_the_claim_is_gone(
        node: Node) -> None:
    """The scheduler allocated a claim on a GPU in the instant the kubelet gave it to a device-plugin pod: the
    claim's prepare is refused, and the GPU, which had left the slice, is back in it with a NoExecute taint
    (kube-controller-manager evicts the claim's pod rather than it waiting in ContainerCreating); once the API
    server no longer has the claim (its pod evicted), the GPU leaves the slice again. Fails on the driver
    before it, which left the held GPU out of the slice whatever claim pointed at it."""
    node.allocate("0000:18:00.0")
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") is None), "still offered to the scheduler"
    node.api.add("loser", CLAIM, [(GPU_POOL, "gpu-0000-18-00-0")])
    answer = prepare(node.driver, ("loser", CLAIM)).claims[CLAIM]
    assert "held by the device plugin" in answer.error
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") is not None), "not back in the slice, tainted"
    assert _taints(node, "gpu-0000-18-00-0") == [
        {"key": f"{DRIVER}/held-by-device-plugin", "value": "nvidia.com-gpu", "effect": "NoExecute",
         "timeAdded": _taints(node, "gpu-0000-18-00-0")[0]["timeAdded"]}]  # type: ignore[index]
    assert _taints(node, "gpu-0000-2a-00-0") == []  # the others untouched
    assert node.driver.health.snapshot()[1][(GPU_POOL, "gpu-0000-18-00-0")][0], "a held device is not unhealthy"
    # the kubelet's retries change nothing; the claim still there: the taint stays
    assert "held by the device plugin" in prepare(node.driver, ("loser", CLAIM)).claims[CLAIM].error
    assert node.driver.check_contests() == []
    assert _taints(node, "gpu-0000-18-00-0") is not None
    # the claim's pod evicted, the claim deleted: the GPU leaves the slice, as any the plugin holds
    del node.api.claims[("default", "loser")]
    assert node.driver.check_contests() == [CLAIM]
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") is None), "the held GPU stayed in the slice"
    assert not node.driver.preparer.contested()


def test_a_contest_ends_when_the_kubelet_unprepares_the_claim_or_prepares_it_after_the_release(node: Node) -> None:
    node.allocate("0000:18:00.0")
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") is None)
    node.api.add("loser", CLAIM, [(GPU_POOL, "gpu-0000-18-00-0")])
    assert prepare(node.driver, ("loser", CLAIM)).claims[CLAIM].error
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") is not None)
    assert unprepare(node.driver, ("loser", CLAIM)).claims[CLAIM].error == ""
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") is None), "the unprepared claim still taints it"
    # refused again, then the plugin's pod ends first: the kubelet's retry is prepared, nothing is tainted
    assert prepare(node.driver, ("loser", CLAIM)).claims[CLAIM].error
    Ledger(str(node.state)).plugin_update({}, ["device-plugin:nvidia.com/gpu:0000:18:00.0"])
    assert prepare(node.driver, ("loser", CLAIM)).claims[CLAIM].error == ""
    assert not node.driver.preparer.contested()
    assert wait(lambda: _taints(node, "gpu-0000-18-00-0") == [])


def test_a_device_a_claim_holds_is_unhealthy_for_the_kubelet_refused_and_avoided_until_unprepared(node: Node) -> None:
    node.api.add("held", CLAIM, [(GPU_POOL, "gpu-0000-2a-00-0")])
    assert prepare(node.driver, ("held", CLAIM)).claims[CLAIM].error == ""
    # the preferred allocation avoids it at once, before the kubelet's list says so
    assert "0000:2a:00.0" not in node.preferred(["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"], 2)
    assert wait(lambda: node.health("0000:2a:00.0") == "Unhealthy"), "the kubelet still counts it"
    assert node.health("0000:18:00.0") == "Healthy"
    with pytest.raises(grpc.RpcError) as refused:
        node.allocate("0000:2a:00.0")
    assert "held by DRA claim dra-claim:dra.devinject.io:" + CLAIM in refused.value.details()
    assert not node.bookings()
    assert unprepare(node.driver, ("held", CLAIM)).claims[CLAIM].error == ""
    assert wait(lambda: node.health("0000:2a:00.0") == "Healthy"), "not offered again"
    node.allocate("0000:2a:00.0")
    assert "device-plugin:nvidia.com/gpu:0000:2a:00.0" in node.bookings()


def test_allocate_and_prepare_racing_for_one_device_never_both_win(node: Node) -> None:
    """The scheduler allocated a claim on a GPU as the kubelet gave it to a pod (neither offer changed yet):
    one of them wins, the other is refused cleanly, every time."""
    devices = [("0000:3a:00.0", "gpu-0000-3a-00-0"), ("0000:5d:00.0", "gpu-0000-5d-00-0"),
               ("0000:9a:00.0", "gpu-0000-9a-00-0"), ("0000:ab:00.0", "gpu-0000-ab-00-0")]
    for round_ in range(3):
        for n, (device_id, name) in enumerate(devices):
            uid = f"0b7f8e7c-3333-4c1b-9a55-{round_:06d}{n:06d}"
            claim = f"race-{round_}-{n}"
            node.api.add(claim, uid, [(GPU_POOL, name)])
            results = _race(node, device_id, claim, uid)
            winners = [k for k, v in results.items() if v is True]
            assert len(winners) == 1, results
            assert "held by" in str(results["claim" if winners == ["plugin"] else "plugin"])
            if winners == ["claim"]:  # free the device again for the next round
                assert unprepare(node.driver, (claim, uid)).claims[uid].error == ""
            else:
                Ledger(str(node.state)).plugin_update({}, [f"device-plugin:nvidia.com/gpu:{device_id}"])


def _race(node: Node, device_id: str, claim: str, uid: str) -> dict[str, object]:
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def plugin() -> None:
        start.wait()
        try:
            node.allocate(device_id)
            results["plugin"] = True
        except grpc.RpcError as err:
            results["plugin"] = err.details()

    def prepared() -> None:
        start.wait()
        answer = prepare(node.driver, (claim, uid)).claims[uid]
        results["claim"] = answer.error or True

    threads = [threading.Thread(target=plugin), threading.Thread(target=prepared)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return results


def test_the_plugins_bookings_outlive_a_restart_a_corrupt_ledger_and_a_lost_one(node: Node) -> None:
    node.allocate("0000:ba:00.0")
    node.checkpoint({POD_B: ["0000:ba:00.0"]})
    node.pod(POD_B)
    assert wait(lambda: node.bookings().get("device-plugin:nvidia.com/gpu:0000:ba:00.0", {}).get("pods") == [POD_B])
    node.api.add("want", CLAIM, [(GPU_POOL, "gpu-0000-ba-00-0")])

    def refused() -> bool:
        return "held by the device plugin" in prepare(node.driver, ("want", CLAIM)).claims[CLAIM].error

    node.stop_plugin()
    assert refused()  # the booking is the node's, not the plugin process's
    node.start_plugin()
    assert refused() and "device-plugin:nvidia.com/gpu:0000:ba:00.0" in node.bookings()
    # a corrupt ledger is rebuilt with the plugin's bookings (kept beside it, as the claims' are)
    (node.state / "ledger.json").write_text("{not json")
    assert refused()
    assert node.bookings()["device-plugin:nvidia.com/gpu:0000:ba:00.0"]["pods"] == [POD_B]
    # both copies lost: the kubelet's checkpoint, for a pod that still exists, books it again
    os.unlink(node.state / "ledger.json")
    os.unlink(node.state / "ledger-claims.json")
    assert wait(lambda: "device-plugin:nvidia.com/gpu:0000:ba:00.0" in node.bookings()
                if (node.state / "ledger.json").exists() else False), "not booked again from the checkpoint"
    assert refused()
    # the refused claim is allocated on it: it stays in the slice, tainted NoExecute, until the claim is gone
    assert wait(lambda: [t["key"] for t in _taints(node, "gpu-0000-ba-00-0") or []] == [
        f"{DRIVER}/held-by-device-plugin"])
    del node.api.claims[("default", "want")]
    assert node.driver.check_contests() == [CLAIM]
    assert wait(lambda: "gpu-0000-ba-00-0" not in node.published())


def test_a_booking_no_pod_took_ends_after_the_grace(node: Node) -> None:
    """Allocate answered, then the kubelet's admission failed (another resource refused): no checkpoint entry
    names a pod for it, and the device is free again after the grace."""
    node.allocate("0000:db:00.0")
    assert wait(lambda: "gpu-0000-db-00-0" not in node.published())
    assert wait(lambda: not node.bookings(), timeout=6), "a booking no pod took holds the device"
    assert wait(lambda: "gpu-0000-db-00-0" in node.published())


def test_a_lost_ledger_does_not_put_the_plugins_devices_back_in_the_slice(node: Node) -> None:
    """ledger.json and its copy gone (or broken) say nothing of what the plugin holds: until the ledger is
    back with the plugin's bookings, what it held stays out of the slices."""
    node.allocate("0000:ab:00.0")
    assert wait(lambda: "gpu-0000-ab-00-0" not in node.published())
    node.stop_plugin()  # it would book the device again from the kubelet's checkpoint at once
    os.unlink(node.state / "ledger.json")
    os.unlink(node.state / "ledger-claims.json")
    node.driver.follow_ledger_once()
    time.sleep(0.5)
    assert "gpu-0000-ab-00-0" not in node.published()
    (node.state / "ledger.json").write_text("{broken")
    time.sleep(0.5)
    assert "gpu-0000-ab-00-0" not in node.published()
    Ledger(str(node.state)).sweep()  # rebuilt, without the plugin's booking (nothing shows it): released
    assert wait(lambda: "gpu-0000-ab-00-0" in node.published())



def test_with_the_plugin_gone_the_driver_releases_a_booking_whose_pod_is_gone(node: Node) -> None:
    """The move to DRA in the usual order: the device plugin's DaemonSet deleted first (the plugin stops with
    its bookings in the ledger), then its pods. Nothing of the plugin's is left to release them: the driver
    does, and the devices are back in its slice."""
    node.allocate("0000:18:00.0", "0000:2a:00.0")
    node.checkpoint({POD_A: ["0000:18:00.0", "0000:2a:00.0"]})
    node.pod(POD_A)
    assert wait(lambda: all(e["pods"] == [POD_A] for e in node.bookings().values()) and len(node.bookings()) == 2)
    node.stop_plugin()
    assert not {"gpu-0000-18-00-0", "gpu-0000-2a-00-0"} & node.published()
    node.pod(POD_A, present=False)  # the kubelet is done with the pod
    assert wait(lambda: not node.bookings()), "the bookings outlived their pod with the plugin gone"
    assert wait(lambda: {"gpu-0000-18-00-0", "gpu-0000-2a-00-0"} <= node.published()), "not offered again"


def test_a_state_dir_carried_over_from_a_rebuilt_cluster_holds_no_device_back(host_copy, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The node's state dir outlived its cluster (purged and rebuilt): the device plugin's bookings name pods
    no kubelet has. A DRA driver started there (no device plugin) publishes every GPU in its first slice."""
    from devinject.nodestate.ledger import Claim

    state, pods = tmp_path / "state", tmp_path / "pods"
    state.mkdir(mode=0o755)
    pods.mkdir()  # the new kubelet's: none of the old pods
    ledger = Ledger(str(state))
    for n, address in enumerate(["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0"]):
        ledger.book_plugin("nvidia.com/gpu", {address: Claim(f"nvidia.com/gpu={n}", (f"c 195:{n}",))},
                           pods={address: [f"5d4a77c7-0000-4000-8000-00000000000{n}"]}, policy={})
    api = FakeApi()
    gen = GenerateOptions(root=str(host_copy("hgx-h100")), hook_path="/usr/bin/devinject")
    driver = DraDriver(DraOptions(generate=gen, node_name=NODE, plugin_dir=str(tmp_path / "plugins"),
                                  registry_dir=str(tmp_path / "registry"), cdi_dir=str(tmp_path / "cdi"),
                                  state_dir=str(state), rescan=3600), api)
    driver.start()
    try:
        driver.refresh()
        gpus = {d["name"] for s in api.slices for d in s["spec"].get("devices", []) if d["name"].startswith("gpu-")}
        assert len(gpus) == 8, sorted(gpus)
        allocations = json.loads((state / "ledger.json").read_text())["allocations"]
        assert not [cid for cid in allocations if cid.startswith("device-plugin:")]
    finally:
        driver.servers.stop()
