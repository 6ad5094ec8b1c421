"""`devinject dra-driver` over real unix sockets, with a kubelet-side client written here: registration
(GetInfo, NotifyRegistrationStatus), NodePrepareResources / NodeUnprepareResources on the fake HGX host (the
claim-scoped CDI spec appears and disappears), a driver restart that keeps the prepared claims (checkpoint),
the ledger's view of a claim, and bad input (an unknown device, opaque config, a corrupt checkpoint): a clear
error for that claim and nothing left behind."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from devinject.cdi.spec import dump
from devinject.core.errors import LedgerError
from devinject.dra.api import dra_v1_pb2 as dra
from devinject.dra.api import dra_v1_pb2_grpc as dra_grpc
from devinject.dra.api import health_v1_pb2 as health
from devinject.dra.api import health_v1_pb2_grpc as health_grpc
from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devinject.dra.claims import ClaimReadError
from devinject.dra.driver import DraDriver, DraOptions
from devinject.nodestate.ledger import Claim, Ledger
from devinject.specs.generate import GenerateOptions, generate_specs
from tests.conftest import HOSTS

DRIVER = "dra.devinject.io"
NODE = "node1"
GPU_POOL = f"{NODE}-nvidia-com-gpu"
NIC_POOL = f"{NODE}-nvidia-com-rdma"


class FakeApi:
    """The API server as the driver sees it: slices published, claims read."""

    def __init__(self) -> None:
        self.slices: list[dict[str, Any]] = []
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        self.slices = desired
        return {}

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if (namespace, name) not in self.claims:
            raise ClaimReadError(f"get resourceclaim {namespace}/{name}: 404 NotFound", 404)
        return json.loads(json.dumps(self.claims[(namespace, name)]))

    def add(self, name: str, uid: str, devices: list[tuple[str, str]], request: str = "gpus",
            config: list[dict[str, Any]] | None = None) -> None:
        results = [{"request": request, "driver": DRIVER, "pool": pool, "device": device} for pool, device in devices]
        results.append({"request": "other", "driver": "gpu.example.com", "pool": "x", "device": "y"})  # not ours
        self.claims[("default", name)] = {
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": config or []}}}}


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(out["state"], mode=0o755)
    return out


def make_driver(dirs: dict[str, str], api: FakeApi) -> DraDriver:
    gen = GenerateOptions(root=str(HOSTS / "hgx-h100"), hook_path="/usr/bin/devinject")
    opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"], registry_dir=dirs["registry"],
                      cdi_dir=dirs["cdi"], state_dir=dirs["state"], rescan=3600)
    return DraDriver(opts, api)


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def driver(dirs: dict[str, str], api: FakeApi) -> Iterator[DraDriver]:
    d = make_driver(dirs, api)
    d.start()
    d.refresh()
    yield d
    d.servers.stop()


def kubelet(path: str) -> grpc.Channel:
    channel = grpc.insecure_channel(f"unix://{path}")
    grpc.channel_ready_future(channel).result(timeout=5)
    return channel


def prepare(driver: DraDriver, *claims: tuple[str, str]) -> dra.NodePrepareResourcesResponse:
    with kubelet(driver.servers.endpoint) as channel:
        return dra_grpc.DRAPluginStub(channel).NodePrepareResources(dra.NodePrepareResourcesRequest(  # type: ignore[no-untyped-call]
            claims=[dra.Claim(namespace="default", name=name, uid=uid) for name, uid in claims]), timeout=10)


def unprepare(driver: DraDriver, *claims: tuple[str, str]) -> dra.NodeUnprepareResourcesResponse:
    with kubelet(driver.servers.endpoint) as channel:
        return dra_grpc.DRAPluginStub(channel).NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(  # type: ignore[no-untyped-call]
            claims=[dra.Claim(namespace="default", name=name, uid=uid) for name, uid in claims]), timeout=10)


def cdi_files(dirs: dict[str, str]) -> list[str]:
    return sorted(os.listdir(dirs["cdi"])) if os.path.isdir(dirs["cdi"]) else []


def test_registration_is_what_the_kubelet_reads(driver: DraDriver, dirs: dict[str, str]) -> None:
    path = os.path.join(dirs["registry"], f"{DRIVER}-reg.sock")
    with kubelet(path) as channel:
        stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        info = stub.GetInfo(reg.InfoRequest(), timeout=5)
        assert (info.type, info.name, list(info.supported_versions)) == (
            "DRAPlugin", DRIVER, ["v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
        assert info.endpoint == os.path.join(dirs["plugins"], DRIVER, "dra.sock")
        assert stat.S_ISSOCK(os.stat(info.endpoint).st_mode)
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error="version"), timeout=5)
        assert driver.servers.registration.error == "version"
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)
        assert driver.servers.registration.registered.is_set()


def test_slices_are_published_at_start(driver: DraDriver, api: FakeApi) -> None:
    pools = {s["spec"]["pool"]["name"] for s in api.slices}
    assert pools == {GPU_POOL, NIC_POOL}


def test_prepare_writes_one_claim_spec_and_unprepare_removes_it(driver: DraDriver, api: FakeApi,
                                                                dirs: dict[str, str]) -> None:
    uid = "0b7f8e7c-1111-4c1b-9a55-000000000001"
    api.add("two", uid, [(GPU_POOL, "gpu-0000-18-00-0"), (NIC_POOL, "rdma-0000-19-00-0")])
    answer = prepare(driver, ("two", uid)).claims[uid]
    assert answer.error == ""
    assert [(d.pool_name, d.device_name, list(d.request_names), list(d.cdi_device_ids)) for d in answer.devices] == [
        (GPU_POOL, "gpu-0000-18-00-0", ["gpus"], [f"{DRIVER}/claim={uid}-gpu-0000-18-00-0"]),
        (NIC_POOL, "rdma-0000-19-00-0", ["gpus"], [f"{DRIVER}/claim={uid}-rdma-0000-19-00-0"])]
    path = Path(dirs["cdi"]) / f"{DRIVER}-{uid}.json"
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o644, 0)
    spec = json.loads(path.read_text())
    assert spec["kind"] == f"{DRIVER}/claim"
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert set(devices) == {f"{uid}-gpu-0000-18-00-0", f"{uid}-rdma-0000-19-00-0"}
    # the same edits `generate` writes for that GPU (index 0) and NIC: one pipeline
    generated = {s.kind: s for s in generate_specs(GenerateOptions(root=str(HOSTS / "hgx-h100"),
                                                                   hook_path="/usr/bin/devinject"))}
    as_json = {kind: json.loads(dump(spec, "json")) for kind, spec in generated.items()}
    gpu0 = next(d for d in as_json["nvidia.com/gpu"]["devices"] if d["name"] == "0")
    nic0 = next(d for d in as_json["nvidia.com/rdma"]["devices"] if d["name"] == "0")
    assert devices[f"{uid}-gpu-0000-18-00-0"] == gpu0["containerEdits"]
    assert devices[f"{uid}-rdma-0000-19-00-0"] == nic0["containerEdits"]
    # the kinds' shared edits (the driver's libraries, /dev/nvidiactl) once, at the spec's level
    assert "/dev/nvidiactl" in [n["path"] for n in spec["containerEdits"]["deviceNodes"]]
    again = prepare(driver, ("two", uid)).claims[uid]  # the kubelet retries: the same answer
    assert list(again.devices) == list(answer.devices)
    assert unprepare(driver, ("two", uid)).claims[uid].error == ""
    assert not path.exists()
    assert unprepare(driver, ("two", uid)).claims[uid].error == ""  # and again: nothing to do, no error


def test_the_prepare_log_says_how_much_of_it_was_the_claims_read(driver: DraDriver, api: FakeApi,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """An admin with slow prepares reads in the driver's log whether the API server or the node took the time."""
    uid = "0b7f8e7c-1111-4c1b-9a55-00000000000a"
    api.add("slow", uid, [(GPU_POOL, "gpu-0000-18-00-0")])
    read = api.get_claim

    def slow_read(namespace: str, name: str) -> dict[str, Any]:
        time.sleep(0.3)
        return read(namespace, name)

    monkeypatch.setattr(driver.preparer, "get_claim", slow_read)
    with caplog.at_level(logging.INFO, logger="devinject"):
        assert prepare(driver, ("slow", uid)).claims[uid].error == ""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared claim default/slow")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    found = re.search(r" in ([0-9.]+) ms, ([0-9.]+) of them reading it: ", lines[0])
    assert found, lines[0]
    total, reading = float(found[1]), float(found[2])
    assert 300 <= reading <= total, lines[0]


def test_a_claimed_device_is_in_the_ledger_for_the_hook_and_the_device_plugin(driver: DraDriver, api: FakeApi,
                                                                              dirs: dict[str, str]) -> None:
    uid = "0b7f8e7c-1111-4c1b-9a55-000000000002"
    api.add("one", uid, [(GPU_POOL, "gpu-0000-2a-00-0")])
    assert prepare(driver, ("one", uid)).claims[uid].error == ""
    ledger = Ledger(dirs["state"])
    gpu1 = Claim("nvidia.com/gpu=1", ("c 195:3",))  # /dev/nvidia3, the GPU at 0000:2a:00.0
    with pytest.raises(LedgerError, match="dra-claim"):
        ledger.book("container-a", os.getpid(), (gpu1,))
    assert unprepare(driver, ("one", uid)).claims[uid].error == ""
    ledger.book("container-a", os.getpid(), (gpu1,))  # free again once the claim is unprepared
    # and the reverse: a device a container holds is not prepared for a claim, and nothing is left behind
    uid2 = "0b7f8e7c-1111-4c1b-9a55-000000000003"
    api.add("late", uid2, [(GPU_POOL, "gpu-0000-2a-00-0")])
    answer = prepare(driver, ("late", uid2)).claims[uid2]
    assert "held by container container-a" in answer.error and not answer.devices
    assert cdi_files(dirs) == []


def test_a_restart_keeps_prepared_claims_and_unprepare_still_cleans(dirs: dict[str, str], api: FakeApi) -> None:
    uid = "0b7f8e7c-1111-4c1b-9a55-000000000004"
    api.add("kept", uid, [(GPU_POOL, "gpu-0000-3a-00-0")])
    first = make_driver(dirs, api)
    first.start()
    try:
        answer = prepare(first, ("kept", uid)).claims[uid]
        assert answer.error == ""
    finally:
        first.servers.stop()
    del api.claims[("default", "kept")]  # the API has forgotten it: only the checkpoint knows
    second = make_driver(dirs, api)
    second.start()
    try:
        assert set(second.preparer.prepared()) == {uid}
        again = prepare(second, ("kept", uid)).claims[uid]
        assert again.error == "" and list(again.devices) == list(answer.devices)
        assert unprepare(second, ("kept", uid)).claims[uid].error == ""
        assert cdi_files(dirs) == [] and second.preparer.prepared() == {}
    finally:
        second.servers.stop()


def test_a_spec_the_checkpoint_does_not_name_is_removed_at_start(dirs: dict[str, str], api: FakeApi) -> None:
    """A crash between writing the spec and the checkpoint leaves a spec: the next start removes it."""
    os.makedirs(dirs["cdi"])
    orphan = Path(dirs["cdi"]) / f"{DRIVER}-0b7f8e7c-dead.json"
    orphan.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": f"{DRIVER}/claim", "devices": []}))  # as written
    other = Path(dirs["cdi"]) / "nvidia.com-gpu.yaml"
    other.write_text("{}")
    driver = make_driver(dirs, api)
    driver.start()
    driver.servers.stop()
    assert cdi_files(dirs) == ["nvidia.com-gpu.yaml"]


@pytest.mark.parametrize(("case", "expected"), [
    ("unknown", "device node1-nvidia-com-gpu/gpu-0000-ff-00-0 is not one this node offers"),
    ("opaque", "status.allocation.devices.config[0].opaque: parameters.'mode': unknown field"),
    ("corrupt", "corrupt checkpoint"),
    ("unallocated", "not allocated"),
    ("uid", "the API has uid"),
])
def test_bad_input_is_a_clear_error_and_leaves_nothing(driver: DraDriver, api: FakeApi, dirs: dict[str, str],
                                                       case: str, expected: str) -> None:
    uid = "0b7f8e7c-1111-4c1b-9a55-0000000000ff"
    good = [(GPU_POOL, "gpu-0000-18-00-0")]
    if case == "unknown":
        api.add("bad", uid, [*good, (GPU_POOL, "gpu-0000-ff-00-0")])
    elif case == "opaque":
        api.add("bad", uid, good, config=[{"source": "FromClaim", "opaque": {"driver": DRIVER,
                                                                              "parameters": {"mode": "fast"}}}])
    elif case == "corrupt":
        api.add("bad", uid, good)
        Path(driver.preparer.checkpoint.path).write_text('{"version": 1, "claims": ')
    elif case == "unallocated":
        api.add("bad", uid, good)
        api.claims[("default", "bad")]["status"] = {}
    else:
        api.add("bad", "another-uid", good)
    answer = prepare(driver, ("bad", uid)).claims[uid]
    assert expected in answer.error and not answer.devices
    if case == "corrupt":
        assert driver.preparer.checkpoint.path in answer.error
    assert cdi_files(dirs) == []
    assert "dra-claim" not in json.dumps(Ledger(dirs["state"]).snapshot()) if case != "corrupt" else True


def test_one_bad_claim_does_not_fail_the_others(driver: DraDriver, api: FakeApi) -> None:
    api.add("good", "uid-good", [(GPU_POOL, "gpu-0000-5d-00-0")])
    api.add("bad", "uid-bad", [(GPU_POOL, "gpu-0000-ff-00-0")])
    answer = prepare(driver, ("good", "uid-good"), ("bad", "uid-bad"))
    assert answer.claims["uid-good"].error == "" and len(answer.claims["uid-good"].devices) == 1
    assert "not one this node offers" in answer.claims["uid-bad"].error
    unprepare(driver, ("good", "uid-good"))


def test_health_stream_lists_every_device(driver: DraDriver) -> None:
    with kubelet(driver.servers.endpoint) as channel:
        stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(  # type: ignore[no-untyped-call]
            health.NodeWatchResourcesRequest(), timeout=5)
        first = next(stream)
        stream.cancel()
    assert len(first.devices) == 16
    assert {d.health for d in first.devices} == {health.HEALTHY}


def devices(api: FakeApi) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in api.slices for d in s["spec"].get("devices", [])}


def test_a_device_watch_took_out_stays_tainted_and_is_unhealthy_until_put_back(driver: DraDriver, api: FakeApi,
                                                                               dirs: dict[str, str]) -> None:
    """A device the health loop took out (health.json, here by its nodes alone) stays in the slice with a
    NoSchedule taint in the driver's domain, and is unhealthy in the health stream; put back, the taint goes."""
    health_file = Path(dirs["state"]) / "health.json"
    health_file.write_text(json.dumps({"unhealthy_nodes": ["c 195:2"]}))  # /dev/nvidia2: the GPU at 18:00.0
    assert driver.refresh()
    published = devices(api)
    (taint,) = published["gpu-0000-18-00-0"]["taints"]
    assert (taint["key"], taint["effect"]) == (f"{DRIVER}/fault", "NoSchedule") and "value" not in taint
    assert "taints" not in published["gpu-0000-2a-00-0"]
    with kubelet(driver.servers.endpoint) as channel:
        stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(  # type: ignore[no-untyped-call]
            health.NodeWatchResourcesRequest(), timeout=5)
        first = next(stream)
        stream.cancel()
    states = {d.device.device_name: (d.health, d.message) for d in first.devices}
    assert states["gpu-0000-18-00-0"] == (health.UNHEALTHY, "taken out by the node's health checks")
    assert states["gpu-0000-2a-00-0"] == (health.HEALTHY, "")
    health_file.write_text(json.dumps({"unhealthy_nodes": []}))
    assert driver.refresh()
    assert "taints" not in devices(api)["gpu-0000-18-00-0"]
    assert not driver.refresh()  # nothing changed: nothing published


def test_a_broken_health_file_keeps_the_taints_the_driver_read_last(driver: DraDriver, api: FakeApi,
                                                                    dirs: dict[str, str]) -> None:
    """health.json cut short (or of another shape): the driver read it as "nothing out" and untainted every
    device the loop had taken out, while the ledger refused them. Now it keeps what it read last."""
    health_file = Path(dirs["state"]) / "health.json"
    health_file.write_text(json.dumps({"unhealthy_nodes": ["c 195:2"]}))
    assert driver.refresh()
    assert devices(api)["gpu-0000-18-00-0"]["taints"]
    health_file.write_text('{"unhealthy_nodes": ["c 19')
    driver.refresh()
    assert devices(api)["gpu-0000-18-00-0"]["taints"]
    assert "taints" not in devices(api)["gpu-0000-2a-00-0"]
    health_file.write_text(json.dumps({"unhealthy_nodes": []}))  # the agent's next write
    assert driver.refresh()
    assert "taints" not in devices(api)["gpu-0000-18-00-0"]


def test_a_lost_ledger_learns_the_prepared_claims_again(driver: DraDriver, api: FakeApi,
                                                        dirs: dict[str, str]) -> None:
    """A ledger rebuilt from live evidence (or gone) knows no claim: the next round books them again, so a
    container cannot take a claimed GPU."""
    uid = "0b7f8e7c-1111-4c1b-9a55-000000000005"
    api.add("held", uid, [(GPU_POOL, "gpu-0000-2a-00-0")])
    assert prepare(driver, ("held", uid)).claims[uid].error == ""
    os.unlink(os.path.join(dirs["state"], "ledger.json"))
    ledger = Ledger(dirs["state"])
    driver.refresh()
    with pytest.raises(LedgerError, match="dra-claim"):
        ledger.book("container-b", os.getpid(), (Claim("nvidia.com/gpu=1", ("c 195:3",)),))
    assert unprepare(driver, ("held", uid)).claims[uid].error == ""


def test_mig_instances_and_their_whole_gpu(dirs: dict[str, str], api: FakeApi) -> None:
    """A MIG instance's spec holds its GPU's node and its own capability nodes; two instances of one GPU go to
    two claims, but the whole GPU is refused on the node too while an instance is prepared (the scheduler's
    counters aside: the ledger books the parent shared for instances and exclusive for the whole)."""
    gen = GenerateOptions(root=str(HOSTS / "dgx-a100-mig"), hook_path="/usr/bin/devinject")
    opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"], registry_dir=dirs["registry"],
                      cdi_dir=dirs["cdi"], state_dir=dirs["state"], rescan=3600)
    driver = DraDriver(opts, api)
    driver.start()
    try:
        driver.refresh()
        api.add("mig0", "uid-mig0", [(GPU_POOL, "gpu-0000-07-00-0-gi1-ci0")])
        api.add("mig1", "uid-mig1", [(GPU_POOL, "gpu-0000-07-00-0-gi2-ci0")])
        api.add("whole", "uid-whole", [(GPU_POOL, "gpu-0000-07-00-0")])
        answer = prepare(driver, ("mig0", "uid-mig0"), ("mig1", "uid-mig1"))
        assert answer.claims["uid-mig0"].error == "" and answer.claims["uid-mig1"].error == ""
        spec = json.loads((Path(dirs["cdi"]) / f"{DRIVER}-uid-mig0.json").read_text())
        (device,) = spec["devices"]
        assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
            "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13",
            "/dev/nvidia-caps/nvidia-cap2"]
        refused = prepare(driver, ("whole", "uid-whole")).claims["uid-whole"]
        assert "held by container dra-claim" in refused.error
        assert sorted(cdi_files(dirs)) == [f"{DRIVER}-uid-mig0.json", f"{DRIVER}-uid-mig1.json"]
        unprepare(driver, ("mig0", "uid-mig0"), ("mig1", "uid-mig1"))
        whole = prepare(driver, ("whole", "uid-whole")).claims["uid-whole"]
        assert whole.error == ""
        spec = json.loads((Path(dirs["cdi"]) / f"{DRIVER}-uid-whole.json").read_text())
        assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == ["/dev/nvidia0"]
        unprepare(driver, ("whole", "uid-whole"))
    finally:
        driver.servers.stop()


def test_claims_left_when_the_kubelets_deadline_nears_are_answered_not_attempted(driver: DraDriver,
                                                                                  api: FakeApi) -> None:
    """A slow API server: the claims done are answered within the kubelet's deadline, the rest say why."""
    api.add("slow1", "uid-slow1", [(GPU_POOL, "gpu-0000-ab-00-0")])
    api.add("slow2", "uid-slow2", [(GPU_POOL, "gpu-0000-ba-00-0")])
    original = api.get_claim

    def slow(namespace: str, name: str) -> dict[str, Any]:
        time.sleep(1.5)
        return original(namespace, name)

    api.get_claim = slow  # type: ignore[method-assign]
    driver.preparer.get_claim = slow
    with kubelet(driver.servers.endpoint) as channel:
        answer = dra_grpc.DRAPluginStub(channel).NodePrepareResources(dra.NodePrepareResourcesRequest(  # type: ignore[no-untyped-call]
            claims=[dra.Claim(namespace="default", name=n, uid=f"uid-{n}") for n in ("slow1", "slow2")]), timeout=2.2)
    assert answer.claims["uid-slow1"].error == ""
    assert answer.claims["uid-slow2"].error.startswith("not attempted:")
    unprepare(driver, ("slow1", "uid-slow1"))


def test_a_subrequests_device_is_named_by_its_base_request(driver: DraDriver, api: FakeApi) -> None:
    """firstAvailable allocates `<request>/<subrequest>`; the kubelet matches containers' claims by the
    request's own name, so that is the name returned."""
    api.add("first", "uid-first", [(GPU_POOL, "gpu-0000-db-00-0")], request="gpu/h100")
    (device,) = prepare(driver, ("first", "uid-first")).claims["uid-first"].devices
    assert list(device.request_names) == ["gpu"]
    unprepare(driver, ("first", "uid-first"))


# --- the node's health loop in the driver: faults as taints -------------------------------------------------
GPU_DIR = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
XID_79 = "kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=0, name=python3, GPU has fallen off the bus.\n"


class Running:
    """The driver's own loop (`run`): its health loop on a thread, over a copy of the HGX host."""

    def __init__(self, root: Path, dirs: dict[str, str], api: FakeApi, **options: Any) -> None:
        from devinject.agent.watch import WatchOptions

        gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject")
        watch = WatchOptions(generate=gen, interval=0.3, recheck=0.1, threshold=2, rescan=3600, uevents=False)
        opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"], registry_dir=dirs["registry"],
                          cdi_dir=dirs["cdi"], state_dir=dirs["state"], rescan=3600, watch=watch, **options)
        import threading

        self.driver = DraDriver(opts, api)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.driver.run, args=(self.stop,), daemon=True)
        self.thread.start()
        if opts.health != "follow":
            wait_for("the health loop's first read of the kernel log", self.reading)

    def reading(self) -> bool:
        """The loop has read the kernel log once (a first start reads what is logged from then on)."""
        loop = self.driver.loop
        return loop is not None and loop.checker.log_position()[1] is not None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def taints_of(api: FakeApi, name: str = "gpu-0000-18-00-0") -> list[tuple[str, str, str]] | None:
    device = devices(api).get(name)
    return None if device is None else [(t["key"], t.get("value", ""), t["effect"]) for t in device.get("taints", [])]


def wait_for(what: str, check: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g}s"
        time.sleep(0.05)


@pytest.fixture
def hgx(tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "host"
    shutil.copytree(HOSTS / "hgx-h100", root, symlinks=True)
    (root / "var/log").mkdir(parents=True, exist_ok=True)
    (root / "var/log/kern.log").write_text("kernel: Linux version 6.1.0\n")
    return root


def test_the_drivers_health_loop_taints_an_xid_and_put_back_clears_it_across_restarts(
        hgx: Path, dirs: dict[str, str], api: FakeApi) -> None:
    """A DRA-only node: the driver's own loop reads the kernel log; a fatal Xid taints the GPU (`xid`, its
    code) and makes it unhealthy in the health stream; a restarted driver (same state dir) keeps the taint;
    `put-back` clears it, and a driver restarted after that does not read the old Xid again."""
    from devinject.agent.healthstate import request_put_back

    running = Running(hgx, dirs, api, health="check")
    try:
        wait_for("the first slices", lambda: taints_of(api) == [])
        with open(hgx / "var/log/kern.log", "a") as log:
            log.write(XID_79)
        wait_for("the Xid taint", lambda: taints_of(api) == [(f"{DRIVER}/xid", "79", "NoSchedule")])
        assert taints_of(api, "gpu-0000-2a-00-0") == []
        assert running.driver.health.snapshot()[1][(GPU_POOL, "gpu-0000-18-00-0")][0] is False
    finally:
        running.close()
    api.slices = []
    running = Running(hgx, dirs, api, health="check")
    try:
        wait_for("the taint after a restart", lambda: taints_of(api) == [(f"{DRIVER}/xid", "79", "NoSchedule")])
        request_put_back(str(hgx), dirs["state"], "nvidia.com/gpu=0000:18:00.0")
        wait_for("the taint cleared by put-back", lambda: taints_of(api) == [])
    finally:
        running.close()
    api.slices = []
    running = Running(hgx, dirs, api, health="check")
    try:
        wait_for("the slices after the second restart", lambda: taints_of(api) is not None)
        time.sleep(1.0)  # several health rounds
        assert taints_of(api) == []
    finally:
        running.close()


def test_fatal_faults_evict_when_the_admin_opts_in_and_a_gpu_off_the_bus_stays_tainted(
        hgx: Path, dirs: dict[str, str], api: FakeApi) -> None:
    """`fatal_effect` NoExecute: a fatal Xid's taint evicts; a GPU whose PCI function is gone (off the bus) is
    still described, tainted `gone`, so the scheduler skips it instead of never hearing of it; an unbound
    one is tainted `unbound`, NoSchedule (an admin's rebind is not a reason to evict)."""
    import shutil

    running = Running(hgx, dirs, api, health="check", fatal_effect="NoExecute")
    try:
        wait_for("the first slices", lambda: taints_of(api) == [])
        with open(hgx / "var/log/kern.log", "a") as log:
            log.write(XID_79)
        wait_for("the Xid taint", lambda: taints_of(api) == [(f"{DRIVER}/xid", "79", "NoExecute")])
        (hgx / "sys/devices/pci0000:24/0000:24:01.0/0000:27:00.0/0000:28:00.0/0000:2a:00.0/driver").unlink()
        running.driver.loop.uevent({"ACTION": "unbind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:2a:00.0"})
        wait_for("the unbound taint", lambda: taints_of(api, "gpu-0000-2a-00-0") == [
            (f"{DRIVER}/unbound", "", "NoSchedule")])
        shutil.rmtree(hgx / GPU_DIR)
        (hgx / "sys/bus/pci/devices/0000:18:00.0").unlink()
        running.driver.loop.uevent({"ACTION": "remove", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:18:00.0"})
        wait_for("the GPU off the bus still described, tainted", lambda: (taints_of(api) or [])[:1] == [
            (f"{DRIVER}/gone", "", "NoExecute")])
        assert devices(api)["gpu-0000-18-00-0"]["attributes"]["resource.kubernetes.io/pciBusID"] == {
            "string": "0000:18:00.0"}
    finally:
        running.close()


def test_auto_follows_another_agents_loop_on_the_state_dir(hgx: Path, dirs: dict[str, str], api: FakeApi) -> None:
    """With `watch` or `device-plugin` holding the state dir's loop, the driver runs none of its own (one loop
    per state dir) and taints what that one's health.json says; `check` refuses to start beside it."""
    from devinject.agent import healthstate

    held = healthstate.take_loop_lock(dirs["state"])
    assert held is not None
    try:
        import subprocess
        import sys

        # the lock is per open file: another process must try it
        probe = subprocess.run([sys.executable, "-c", "import sys; from devinject.agent import healthstate; "
                                "sys.exit(0 if healthstate.take_loop_lock(sys.argv[1]) is None else 1)",
                                dirs["state"]], timeout=60)
        assert probe.returncode == 0
    finally:
        os.close(held)
    code = ("import sys, time; from devinject.agent import healthstate; fd = healthstate.take_loop_lock(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", code, dirs["state"]], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        Path(dirs["state"], "health.json").write_text(json.dumps({
            "unhealthy_nodes": ["c 195:2"], "devices": {"nvidia.com/gpu=0000:18:00.0": {
                "published": "unhealthy", "reasons": ["0000:18:00.0: fatal Xid 48"]}}}))
        running = Running(hgx, dirs, api, health="follow")
        running.driver = running.driver  # follows: no loop to wait for
        try:
            wait_for("the followed verdict's taint", lambda: taints_of(api) == [(f"{DRIVER}/xid", "48", "NoSchedule")])
            assert running.driver.loop is None
        finally:
            running.close()
        with pytest.raises(Exception, match="another agent's health loop"):
            make = DraDriver(replace(running.driver.opts, health="check"), api)
            make.start_health_loop(running.stop)
    finally:
        holder.kill()
        holder.wait(10)


def test_a_gpu_unbound_and_bound_again_follows_in_the_slice_at_once(hgx: Path, dirs: dict[str, str],
                                                                    api: FakeApi) -> None:
    """The devices the health loop finds change (unbound: no longer discovered; bound again: found): the
    driver discovers again at once, so the GPU is tainted `unbound` while out, back untainted when bound,
    and tainted again at the next unbind, never missing from the slice between its rescans (an hour here)."""
    link = hgx / GPU_DIR / "driver"
    target = os.readlink(link)
    running = Running(hgx, dirs, api, health="check")
    assert running.driver.loop is not None
    try:
        wait_for("the first slices", lambda: taints_of(api) == [])
        for _ in range(2):
            link.unlink()
            running.driver.loop.uevent({"ACTION": "unbind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:18:00.0"})
            wait_for("the unbound taint", lambda: taints_of(api) == [(f"{DRIVER}/unbound", "", "NoSchedule")])
            wait_for("the unbound GPU no longer discovered", lambda: (GPU_POOL, "gpu-0000-18-00-0") not in
                     running.driver.inventory().offers)
            assert taints_of(api) == [(f"{DRIVER}/unbound", "", "NoSchedule")]  # kept as it was described
            link.symlink_to(target)
            running.driver.loop.uevent({"ACTION": "bind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:18:00.0"})
            wait_for("the GPU back untainted", lambda: taints_of(api) == [])
    finally:
        running.close()


def test_a_gpu_discovery_lost_before_the_loop_judged_it_is_tainted_once_it_does(hgx: Path, dirs: dict[str, str],
                                                                               api: FakeApi) -> None:
    """The driver's discovery may see a function unbound before the health loop's next round: the GPU is
    left out of the slice meanwhile, but kept as it was described, so the loop's verdict taints it then
    (it is not forgotten as if a MIG layout had changed)."""
    gen = GenerateOptions(root=str(hgx), hook_path="/usr/bin/devinject")
    driver = DraDriver(DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"],
                                  registry_dir=dirs["registry"], cdi_dir=dirs["cdi"], state_dir=dirs["state"],
                                  rescan=3600, health="follow"), api)
    driver.refresh()
    assert taints_of(api) == []
    (hgx / GPU_DIR / "driver").unlink()
    driver.refresh()  # discovered again before the loop judged it
    assert taints_of(api) is None
    Path(dirs["state"], "health.json").write_text(json.dumps({"devices": {"nvidia.com/gpu=0000:18:00.0": {
        "published": "unhealthy", "reasons": ["0000:18:00.0: driver unbound"]}}}))
    assert driver.refresh(rediscover=False)
    assert taints_of(api) == [(f"{DRIVER}/unbound", "", "NoSchedule")]


def test_a_slow_api_answer_for_one_claim_does_not_delay_an_unrelated_prepare(driver: DraDriver, api: FakeApi,
                                                                             dirs: dict[str, str]) -> None:
    """The API server is asked with no lock held: while one claim's read hangs (an API server slow to answer,
    or retrying), another claim is prepared and unprepared at once, and a prepared claim is answered from the
    checkpoint. The driver used to read claims under the prepare lock: an unrelated NodePrepareResources
    waited for the slow answer (11.9 s on the real cluster)."""
    import threading

    slow, fast, known = ("slow", "0b7f8e7c-5555-4c1b-9a55-000000000001"), \
        ("fast", "0b7f8e7c-5555-4c1b-9a55-000000000002"), ("known", "0b7f8e7c-5555-4c1b-9a55-000000000003")
    api.add(slow[0], slow[1], [(GPU_POOL, "gpu-0000-18-00-0")])
    api.add(fast[0], fast[1], [(GPU_POOL, "gpu-0000-2a-00-0")])
    api.add(known[0], known[1], [(GPU_POOL, "gpu-0000-3a-00-0")])
    assert prepare(driver, known).claims[known[1]].error == ""
    asked, release = threading.Event(), threading.Event()
    answer = api.get_claim

    def get_claim(namespace: str, name: str) -> dict[str, Any]:
        if name == "slow":
            asked.set()
            release.wait(20)
        return answer(namespace, name)

    driver.preparer.get_claim = get_claim  # type: ignore[method-assign]
    waiting = threading.Thread(target=prepare, args=(driver, slow))
    waiting.start()
    try:
        assert asked.wait(5)
        started = time.monotonic()
        assert prepare(driver, fast).claims[fast[1]].error == ""
        assert prepare(driver, known).claims[known[1]].error == ""
        assert unprepare(driver, fast).claims[fast[1]].error == ""
        assert time.monotonic() - started < 2
    finally:
        release.set()
        waiting.join(20)
    assert sorted(driver.preparer.prepared()) == sorted([slow[1], known[1]])


def test_auto_hands_the_loop_back_to_the_agent_that_owns_it(hgx: Path, dirs: dict[str, str], api: FakeApi) -> None:
    """`--health auto` took the loop over while the device plugin was down (killed, its container restarting):
    when the plugin's loop starts again it asks for the state dir and the driver hands its loop over, so one
    loop runs per state dir (before, both ran: the plugin warned "another health loop runs" and both rewrote
    the health state; the soak test found it after a SIGKILL of the plugin). The driver then follows the
    plugin's verdicts (at once, not at its next rescan), and can take the loop over again once the plugin is
    gone."""
    import subprocess
    import sys
    import threading

    from devinject.agent import healthstate
    from devinject.agent.watch import Watcher

    running = Running(hgx, dirs, api, health="auto")
    try:
        assert running.driver.loop is not None  # nobody else: the driver's loop stands in
        plugin_loop = Watcher(running.driver.opts.watch_options())
        plugin_stop = threading.Event()
        plugin = threading.Thread(target=plugin_loop.run, args=(plugin_stop,), daemon=True)
        plugin.start()
        wait_for("the plugin's loop holding the state dir", lambda: plugin_loop.loop_lock is not None)
        assert running.driver.loop is None
        probe = [sys.executable, "-c", "import sys; from devinject.agent import healthstate; "
                 "sys.exit(0 if healthstate.take_loop_lock(sys.argv[1]) is None else 1)", dirs["state"]]
        assert subprocess.run(probe, timeout=60).returncode == 0  # held, by the plugin's loop alone
        assert not healthstate.loop_wanted(dirs["state"])  # the request withdrawn once served
        wait_for("the plugin's loop reading the kernel log", lambda: plugin_loop.checker.log_position()[1] is not None)
        with open(hgx / "var/log/kern.log", "a") as log:
            log.write(XID_79)
        wait_for("the plugin's verdict followed as a taint", lambda: taints_of(api) == [
            (f"{DRIVER}/xid", "79", "NoSchedule")], timeout=30)
        plugin_stop.set()
        plugin.join(15)
        assert not plugin.is_alive() and plugin_loop.loop_lock is None
        assert running.driver.start_health_loop(running.stop)  # as its next rescan does: the lock is free
        assert running.driver.loop is not None
    finally:
        running.close()


def labels_in(directory: Path) -> dict[str, str]:
    path = directory / "devinject"
    if not path.exists():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_a_dra_only_node_writes_nfds_feature_file_and_a_taken_out_gpu_leaves_the_count(
        hgx: Path, dirs: dict[str, str], api: FakeApi, tmp_path: Path) -> None:
    """`--nfd-features-dir`: the driver writes NFD's feature file as `watch` and `device-plugin` do (agent/nfd.py),
    from its own discovery, so a node that runs the DRA driver alone is labelled; the GPU its own health loop
    takes out for a fatal Xid is not counted, and counted again once put back. The embedded loop writes no
    second copy."""
    from devinject.agent.healthstate import request_put_back
    from devinject.agent.nfd import features

    features_dir = tmp_path / "features.d"
    features_dir.mkdir()
    running = Running(hgx, dirs, api, health="check", nfd_features_dir=str(features_dir))
    try:
        assert running.driver.opts.watch_options().nfd_features_dir is None
        wait_for("the feature file", lambda: labels_in(features_dir).get("devinject.io/nvidia.com-gpu.count") == "8")
        from devinject.discovery.node import Node

        node = Node(str(hgx))
        assert (features_dir / "devinject").read_text() == "\n".join(features(node.host, node.devices())) + "\n"
        with open(hgx / "var/log/kern.log", "a") as log:
            log.write(XID_79)
        wait_for("the Xid'd GPU out of the count",
                 lambda: labels_in(features_dir).get("devinject.io/nvidia.com-gpu.count") == "7")
        assert labels_in(features_dir)["devinject.io/nvidia.com-gpu.numa0"] == "3"
        request_put_back(str(hgx), dirs["state"], "nvidia.com/gpu=0000:18:00.0")
        wait_for("the GPU counted again",
                 lambda: labels_in(features_dir).get("devinject.io/nvidia.com-gpu.count") == "8")
        assert not [p for p in features_dir.iterdir() if p.name != "devinject"]  # no dot-file left behind
    finally:
        running.close()


def test_a_driver_following_another_agents_loop_still_writes_the_labels(dirs: dict[str, str], api: FakeApi,
                                                                        tmp_path: Path) -> None:
    """`--health follow` (another agent's loop writes health.json): the driver writes the feature file from
    its discovery and that health.json; no feature dir given, nothing is written."""
    features_dir = tmp_path / "features.d"
    features_dir.mkdir()
    driver = make_driver(dirs, api)
    driver.refresh()
    assert list(features_dir.iterdir()) == [] and not driver.write_labels()
    driver = DraDriver(replace(driver.opts, health="follow", nfd_features_dir=str(features_dir)), api)
    driver.refresh()
    assert labels_in(features_dir)["devinject.io/nvidia.com-gpu.count"] == "8"
    (Path(dirs["state"]) / "health.json").write_text(json.dumps(
        {"unhealthy_nodes": ["c 195:2"], "devices": {"nvidia.com/gpu=0000:18:00.0": {
            "published": "unhealthy", "reasons": ["xid 79"]}}}))
    driver.refresh(rediscover=False)
    assert labels_in(features_dir)["devinject.io/nvidia.com-gpu.count"] == "7"
    assert not driver.write_labels()  # unchanged: not written again
    # a broken health.json stops neither the labels nor the slices: what it said last stands
    (Path(dirs["state"]) / "health.json").write_text('{"unhealthy_nodes": ["c 19')
    api.slices = []  # gone from the API server: the next round must publish them again
    driver.refresh(rediscover=False)
    assert devices(api)["gpu-0000-18-00-0"]["taints"]
    assert labels_in(features_dir)["devinject.io/nvidia.com-gpu.count"] == "7"
