"""Device health as 1.36 and 1.37 kubelets read it, over the driver's real sockets. A 1.37 kubelet (kubernetes
PR #139477) opens a health stream only for a service the plugin advertises in its registration's
`supported_versions`: "v1.DRAResourceHealth" preferred, else "v1alpha1.DRAResourceHealth", nothing advertised
no stream, and an `Unimplemented` answer ends it for good; a 1.36 kubelet opens v1alpha1 whatever is
advertised. No 1.37 kubelet runs here, so `Kubelet137` plays that rule against the driver. Before, the driver
advertised only "v1.DRAPlugin" and served v1alpha1 (without fields 4 and 5) and a never-released v1beta1: a
1.37 kubelet opened no stream, and a failing GPU never reached pod status."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from devinject.dra import kubeletplugin
from devinject.dra.api import health_v1_pb2, health_v1_pb2_grpc, health_v1alpha1_pb2, health_v1alpha1_pb2_grpc
from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devinject.dra.driver import DraDriver
from tests.conftest import HOSTS
from tests.integration.test_dra_driver import (
    GPU_DIR,
    GPU_POOL,
    NIC_POOL,
    FakeApi,
    Running,
    api,
    dirs,
    driver,
    kubelet,
    prepare,
    unprepare,
    wait_for,
)

__all__ = ["api", "dirs", "driver"]  # test_dra_driver's fixtures

# the health services a 1.37 kubelet knows, in its order of preference
HEALTH_SERVICES: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1.DRAResourceHealth": (health_v1_pb2, health_v1_pb2_grpc),
    "v1alpha1.DRAResourceHealth": (health_v1alpha1_pb2, health_v1alpha1_pb2_grpc),
}
UID = "0b7f8e7c-3939-4c1b-9a55-000000000001"
GPU, NIC = "gpu-0000-18-00-0", "rdma-0000-19-00-0"


def pick_health_service(supported_versions: list[str]) -> str | None:
    """A 1.37 kubelet's choice (its TestPickHealthService): v1 when advertised, else v1alpha1, else none."""
    return next((name for name in HEALTH_SERVICES if name in supported_versions), None)


class Kubelet137:
    """What a 1.37 kubelet does with a DRA plugin's health: read the registration over its socket, pick the
    health service from what it advertises, and open that one stream on the plugin's endpoint."""

    def __init__(self, registration_path: str) -> None:
        with kubelet(registration_path) as channel:
            self.info = reg_grpc.RegistrationStub(channel).GetInfo(  # type: ignore[no-untyped-call]
                reg.InfoRequest(), timeout=5)
        self.service = pick_health_service(list(self.info.supported_versions))

    def watch(self, channel: grpc.Channel) -> Iterator[Any] | None:
        """The stream of the service it picked; None when it picked none (no stream is opened)."""
        if self.service is None:
            return None
        api, api_grpc = HEALTH_SERVICES[self.service]
        stream: Iterator[Any] = api_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            api.NodeWatchResourcesRequest(), timeout=30)
        return stream


@pytest.mark.parametrize(("advertised", "opened"), [
    (kubeletplugin.SUPPORTED_VERSIONS, "v1.DRAResourceHealth"),  # what the driver says: v1 is preferred
    (("v1.DRAPlugin", "v1alpha1.DRAResourceHealth"), "v1alpha1.DRAResourceHealth"),
    (("v1.DRAPlugin",), None),  # the driver before: a 1.37 kubelet opens no stream at all
])
def test_a_1_37_kubelet_opens_the_health_service_the_registration_advertises(
        driver: DraDriver, monkeypatch: pytest.MonkeyPatch, advertised: tuple[str, ...],
        opened: str | None) -> None:
    monkeypatch.setattr(kubeletplugin, "SUPPORTED_VERSIONS", advertised)
    node = Kubelet137(driver.servers.registration_path)
    assert node.info.endpoint == driver.servers.endpoint
    assert node.service == opened
    with kubelet(node.info.endpoint) as channel:
        stream = node.watch(channel)
        if opened is None:
            assert stream is None
            return
        assert stream is not None
        first = next(stream)  # served: no Unimplemented, which would end the stream for good
        stream.cancel()
    assert len(first.devices) == 16 and {d.health for d in first.devices} == {HEALTH_SERVICES[opened][0].HEALTHY}


def test_the_driver_advertises_both_health_services_and_serves_each(driver: DraDriver) -> None:
    node = Kubelet137(driver.servers.registration_path)
    advertised = [v for v in node.info.supported_versions if v.endswith(".DRAResourceHealth")]
    assert advertised == ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
    with kubelet(node.info.endpoint) as channel:
        for name in advertised:
            api, api_grpc = HEALTH_SERVICES[name]
            stream = api_grpc.DRAResourceHealthStub(channel).NodeWatchResources(api.NodeWatchResourcesRequest(),
                                                                                timeout=10)
            assert len(next(stream).devices) == 16, name
            stream.cancel()


def test_an_unchanged_list_is_sent_again_before_the_kubelet_reads_it_as_unknown(
        driver: DraDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet reads a device whose last update is older than its health_check_timeout_seconds as
    UNKNOWN: with nothing changed, a stream sends the whole list again every HEALTH_RESEND s (here 0.2), each
    time stamped afresh, well within the timeout it states."""
    assert kubeletplugin.HEALTH_RESEND * 3 <= kubeletplugin.HEALTH_TIMEOUT_SECONDS
    monkeypatch.setattr(kubeletplugin, "HEALTH_RESEND", 0.2)
    monkeypatch.setattr(kubeletplugin, "HEALTH_POLL", 0.05)
    with kubelet(driver.servers.endpoint) as channel:
        stream = health_v1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(  # type: ignore[no-untyped-call]
            health_v1_pb2.NodeWatchResourcesRequest(), timeout=20)
        first, second, third = next(stream), next(stream), next(stream)
        stream.cancel()
    assert len(first.devices) == 16
    for again in (second, third):
        assert [(d.device, d.health) for d in again.devices] == [(d.device, d.health) for d in first.devices]


@dataclass
class Watched:
    """One health stream read on its own thread: each message with the monotonic time it arrived."""

    name: str
    stream: Any
    got: list[tuple[float, Any]] = field(default_factory=list)
    error: BaseException | None = None

    def read(self) -> None:
        try:
            for message in self.stream:
                self.got.append((time.monotonic(), message))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.error = err

    def first(self, check: Any, after: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        """(when, devices by name) of the first message from `after` on whose devices pass `check`."""
        for when, message in list(self.got):
            devices = {d.device.device_name: d for d in message.devices}
            if when >= after and check(devices):
                return when, devices
        return None


def test_v1_and_v1alpha1_streams_report_the_prepared_devices_and_an_unbound_gpu_within_a_second(
        tmp_path: Path, dirs: dict[str, str]) -> None:
    """On the HGX fixture host with the driver's own health loop: a GPU+NIC claim prepared, a v1 and a
    v1alpha1 stream each list both devices HEALTHY with a timeout (field 4); the GPU's driver unbound, each
    says it UNHEALTHY with a one-line message naming the fault (field 5) within 1 s, the NIC still HEALTHY."""
    host = tmp_path / "host"
    shutil.copytree(HOSTS / "hgx-h100", host, symlinks=True)
    (host / "var/log").mkdir(parents=True, exist_ok=True)
    (host / "var/log/kern.log").write_text("kernel: Linux version 6.1.0\n")
    api = FakeApi()
    api.add("pair", UID, [(GPU_POOL, GPU), (NIC_POOL, NIC)])
    running = Running(host, dirs, api, health="check")
    watched: list[Watched] = []
    try:
        wait_for("the driver's sockets", lambda: os.path.exists(running.driver.servers.endpoint))
        assert prepare(running.driver, ("pair", UID)).claims[UID].error == ""
        channel = kubelet(running.driver.servers.endpoint)
        for name, (api_module, api_grpc) in HEALTH_SERVICES.items():
            stream = api_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                api_module.NodeWatchResourcesRequest(), timeout=60)
            watched.append(Watched(name, stream))
        for one in watched:
            threading.Thread(target=one.read, daemon=True).start()
        for one, (api_module, _) in zip(watched, HEALTH_SERVICES.values(), strict=True):
            wait_for(f"{one.name}'s first list", lambda one=one: one.got)
            _, first = one.first(lambda devices: True) or (0.0, {})
            assert {GPU, NIC} <= set(first), one.name
            for name in (GPU, NIC):
                device = first[name]
                assert (device.health, device.message) == (api_module.HEALTHY, ""), (one.name, name)
                assert device.health_check_timeout_seconds == kubeletplugin.HEALTH_TIMEOUT_SECONDS > 0
                assert abs(device.last_updated_time - time.time()) < 60
        (host / GPU_DIR / "driver").unlink()
        unbound = time.monotonic()
        running.driver.loop.uevent({"ACTION": "unbind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:18:00.0"})
        for one, (api_module, _) in zip(watched, HEALTH_SERVICES.values(), strict=True):
            def gpu_down(devices: dict[str, Any], api_module: ModuleType = api_module) -> bool:
                return devices[GPU].health == api_module.UNHEALTHY  # type: ignore[no-any-return]

            wait_for(f"{GPU} unhealthy on {one.name}", lambda one=one, check=gpu_down: one.first(check, unbound))
            when, devices = one.first(gpu_down, unbound) or (0.0, {})
            assert one.error is None, one.error
            assert when - unbound < 1.0, f"{one.name}: {when - unbound:.2f} s from the unbind"
            assert devices[GPU].message == "0000:18:00.0: driver unbound", one.name
            assert "\n" not in devices[GPU].message
            assert devices[NIC].health == api_module.HEALTHY
        for one in watched:
            one.stream.cancel()
        channel.close()
        assert unprepare(running.driver, ("pair", UID)).claims[UID].error == ""
    finally:
        for one in watched:
            one.stream.cancel()
        running.close()
