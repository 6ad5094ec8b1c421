"""The kubelet device plugin API (v1beta1) over gRPC on unix sockets: one `DevicePlugin` server per resource,
and registration with the kubelet's `Registration` service."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from devinject.agent.mps import LOG_IN_CONTAINER, PIPE_IN_CONTAINER, Daemon
from devinject.cdi.model import Spec
from devinject.deviceplugin.allocation import HEALTHY, UNHEALTHY, AllocationError, PluginDevice, answer, preferred
from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.deviceplugin.api import v1beta1_pb2_grpc as api_grpc
from devinject.deviceplugin.sharing import check_replicas, preferred_replicas
from devinject.nodestate.grants import GrantError, grant_env_key, prune, write_grant

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT = 5.0
STREAM_POLL = 1.0  # how often an idle ListAndWatch stream checks that the kubelet is still there
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL


@dataclass
class ResourceState:
    """One resource's devices and spec, shared by its server's threads and the health loop."""

    resource: str
    kind: str
    devices: dict[str, PluginDevice] = field(default_factory=dict)
    spec: Spec | None = None
    version: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)

    def update(self, devices: dict[str, PluginDevice], spec: Spec | None) -> bool:
        """New devices (or health, or spec); wakes every ListAndWatch stream when the list changed."""
        with self.changed:
            self.spec = spec
            if devices == self.devices:
                return False
            self.devices = devices
            self.version += 1
            self.changed.notify_all()
            return True

    def snapshot(self) -> tuple[int, dict[str, PluginDevice], Spec | None]:
        with self.changed:
            return self.version, dict(self.devices), self.spec

    def wait(self, seen: int, timeout: float) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen, timeout=timeout)


def device_message(device: PluginDevice) -> api.Device:
    topology = api.TopologyInfo(nodes=[api.NUMANode(ID=device.place.numa)]) if device.place.numa is not None else None
    return api.Device(ID=device.id, health=HEALTHY if device.offered else UNHEALTHY, topology=topology)


def mps_client(daemon_of: Callable[[str], Daemon | None], devices: dict[str, PluginDevice], ids: list[str],
               envs: dict[str, str], mounts: list[tuple[str, str, bool]]) -> None:
    """What an MPS client needs in Allocate's answer: its replica's own daemon's pipe and log directories
    mounted where CUDA looks (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY) and its share of the GPU's
    threads (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: 100 / replicas, as NVIDIA's daemon's default). AllocationError
    when that daemon is not running (a client without one would fall back to the GPU unshared)."""
    for device_id in ids:
        device = devices.get(device_id)
        daemon = daemon_of(device_id) if device is not None else None
        if device is None or daemon is None:
            raise AllocationError(f"{device_id}: the MPS control daemon of this replica is not running; not "
                                  "allocated")
        envs.update({"CUDA_MPS_PIPE_DIRECTORY": PIPE_IN_CONTAINER, "CUDA_MPS_LOG_DIRECTORY": LOG_IN_CONTAINER,
                     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, 100 // max(1, device.replicas)))})
        # the log directory read-only: the root daemon writes there, and no pod may plant a link for it
        mounts += [(PIPE_IN_CONTAINER, daemon.pipe_dir, False), (LOG_IN_CONTAINER, daemon.log_dir, True)]


class DevicePluginService(api_grpc.DevicePluginServicer):
    def __init__(self, state: ResourceState, *, fallback: bool = True, stopping: threading.Event | None = None,
                 on_allocate: Callable[[str, int | None], None] | None = None,
                 on_stream_end: Callable[[str], None] | None = None, grant_dir: str | None = None,
                 book: Callable[[str, list[PluginDevice]], None] | None = None,
                 held_now: Callable[[dict[str, PluginDevice]], dict[str, str]] | None = None,
                 beside_dra: Callable[[], bool] | None = None,
                 fail_requests_greater_than_one: bool = False,
                 mps: Callable[[str], Daemon | None] | None = None) -> None:
        self.fail_requests_greater_than_one = fail_requests_greater_than_one  # time-sliced replicas: one each
        self.mps = mps  # a resource shared through MPS: replica -> its running daemon (None: not running)
        self.state = state
        self.grant_dir = grant_dir  # the state dir grants are written in (nodestate/grants.py); None: none
        self.book = book  # the ledger's booking of what Allocate hands out (AllocationError: refused)
        self.held_now = held_now  # devices the other path holds, read at the call
        self.beside_dra = beside_dra  # a DRA driver serves this node too: pick from the other end
        self.fallback = fallback
        self.stopping = stopping or threading.Event()
        self.on_allocate = on_allocate
        self.on_stream_end = on_stream_end  # told the kind when the last stream of the current epoch ends
        self.epoch = 0  # one per registration (and per server start): older streams are not the kubelet's now
        self.streams: dict[int, int] = {}  # epoch -> ListAndWatch streams open
        self.streams_lock = threading.Lock()

    def new_epoch(self) -> None:
        with self.streams_lock:
            self.epoch += 1

    def _stream_opened(self) -> int:
        with self.streams_lock:
            self.streams[self.epoch] = self.streams.get(self.epoch, 0) + 1
            return self.epoch

    def _stream_closed(self, epoch: int) -> None:
        with self.streams_lock:
            self.streams[epoch] -= 1
            if self.streams[epoch]:
                return
            del self.streams[epoch]
            if epoch != self.epoch:
                return
        if self.on_stream_end is not None and not self.stopping.is_set():
            self.on_stream_end(self.state.kind)

    def GetDevicePluginOptions(self, request: api.Empty, context: grpc.ServicerContext) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: api.Empty, context: grpc.ServicerContext) -> Iterator[api.ListAndWatchResponse]:
        epoch = self._stream_opened()
        context.add_callback(lambda: self._stream_closed(epoch))  # on any end: the kubelet's, ours, an error
        seen = -1
        while context.is_active() and not self.stopping.is_set():
            version, devices, _ = self.state.snapshot()
            if version != seen:
                seen = version
                yield api.ListAndWatchResponse(devices=[device_message(d) for _, d in sorted(devices.items())])
            self.state.wait(seen, STREAM_POLL)

    def GetPreferredAllocation(self, request: api.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> api.PreferredAllocationResponse:
        _, devices, _ = self.state.snapshot()
        avoid = {i for i, d in devices.items() if d.held}
        if self.held_now is not None:
            avoid |= set(self.held_now(devices))
        if any(d.parent for d in devices.values()):  # time-sliced: replicas of the least-shared devices
            parents = {devices[i].parent for i in avoid if i in devices}
            return api.PreferredAllocationResponse(container_responses=[
                api.ContainerPreferredAllocationResponse(deviceIDs=preferred_replicas(
                    devices, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size,
                    parents))
                for r in request.container_requests])
        return api.PreferredAllocationResponse(container_responses=[
            api.ContainerPreferredAllocationResponse(deviceIDs=preferred(
                devices, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size, avoid,
                from_top=self.beside_dra is not None and self.beside_dra()))
            for r in request.container_requests])

    def Allocate(self, request: api.AllocateRequest, context: grpc.ServicerContext) -> api.AllocateResponse:
        _, devices, spec = self.state.snapshot()
        responses = []
        try:
            if spec is None:
                raise AllocationError(f"{self.state.resource}: no devices to allocate")
            for container in request.container_requests:
                check_replicas(devices, list(container.devices_ids),
                               fail_greater_than_one=self.fail_requests_greater_than_one)
                given = answer(self.state.resource, spec, devices, list(container.devices_ids),
                               fallback=self.fallback)
                envs = dict(given.envs)
                mounts = list(given.mounts)
                if self.mps is not None:
                    mps_client(self.mps, devices, list(container.devices_ids), envs, mounts)
                if self.grant_dir is not None:  # the hook's proof, in a pod, that these devices are this container's
                    envs[grant_env_key(self.state.resource)] = self._grant(given.cdi_devices)
                responses.append(api.ContainerAllocateResponse(
                    envs=envs, annotations=given.annotations,
                    cdi_devices=[api.CDIDevice(name=name) for name in given.cdi_devices],
                    devices=[api.DeviceSpec(container_path=c, host_path=h, permissions=p) for c, h, p in given.devices],
                    mounts=[api.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in mounts]))
            if self.book is not None:  # all of the request's devices or none, under the ledger's lock
                self.book(self.state.resource, [devices[i] for c in request.container_requests
                                                for i in c.devices_ids])
        except AllocationError as err:
            log.warning("%s: Allocate refused: %s", self.state.resource, err.message)
            if self.on_allocate is not None:
                self.on_allocate(self.state.resource, None)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.state.resource}: {err.message}")
        given_ids = [" ".join(c.devices_ids) for c in request.container_requests]
        log.info("%s: Allocate for %d container%s: %s", self.state.resource, len(given_ids),
                 "" if len(given_ids) == 1 else "s", " | ".join(given_ids))
        if self.on_allocate is not None:
            self.on_allocate(self.state.resource, sum(len(c.devices_ids) for c in request.container_requests))
        return api.AllocateResponse(container_responses=responses)

    def _grant(self, names: tuple[str, ...]) -> str:
        assert self.grant_dir is not None
        try:
            prune(self.grant_dir)
            return write_grant(self.grant_dir, self.state.resource, names)
        except GrantError as err:
            raise AllocationError(err.message) from None

    def PreStartContainer(self, request: api.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()


class ResourceServer:
    """A `DevicePlugin` gRPC server for one resource on `<plugin dir>/<endpoint>`."""

    def __init__(self, service: DevicePluginService, plugin_dir: str, endpoint: str) -> None:
        self.service = service
        self.plugin_dir = plugin_dir
        self.endpoint = endpoint
        self.path = os.path.join(plugin_dir, endpoint)
        self.server: grpc.Server | None = None
        self.socket_ino: int | None = None

    def start(self) -> None:
        if len(self.path.encode()) > MAX_SOCKET_PATH:
            raise OSError(f"{self.path}: too long for a unix socket ({MAX_SOCKET_PATH} bytes at most)")
        self.stop()
        try:
            os.unlink(self.path)  # a socket left by an earlier run of the plugin
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"dp-{self.endpoint}"))
        api_grpc.add_DevicePluginServicer_to_server(self.service, server)  # type: ignore[no-untyped-call]
        try:
            server.add_insecure_port(f"unix://{self.path}")
            os.chmod(self.path, 0o600)  # the kubelet alone: Allocate writes the grants the hook trusts in pods
        except RuntimeError:
            raise OSError(f"{self.path}: cannot listen on this socket") from None
        except OSError:
            server.stop(None)
            raise
        server.start()
        self.server = server
        self.socket_ino = os.stat(self.path).st_ino

    def alive(self) -> bool:
        """Serving, and its socket is still the one it made (the kubelet removes plugin sockets when it starts)."""
        try:
            return self.server is not None and os.stat(self.path).st_ino == self.socket_ino
        except OSError:
            return False

    def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1)
            self.server = None

    def close(self, grace: float = 1.0) -> None:
        """Stop serving for good (the agent exits: its pod deleted by an uninstall or a roll) and remove the
        socket, which the kubelet leaves in its directory (gRPC's own unlink at shutdown did not happen in the
        agent's pod: tests/e2e/test_cluster_live.py), while it is still the one this server made: one made
        since in its place (a new agent's) is left alone."""
        made, self.socket_ino = self.socket_ino, None
        self.stop(grace)
        try:
            if made is not None and os.stat(self.path).st_ino == made:
                os.unlink(self.path)
        except OSError:
            pass


def register(plugin_dir: str, endpoint: str, resource: str, timeout: float = REGISTER_TIMEOUT) -> None:
    """Register `resource` served on `endpoint` with the kubelet (raises grpc.RpcError or
    grpc.FutureTimeoutError when the kubelet is not there or refuses)."""
    with grpc.insecure_channel(f"unix://{os.path.join(plugin_dir, KUBELET_SOCKET)}") as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        api_grpc.RegistrationStub(channel).Register(api.RegisterRequest(  # type: ignore[no-untyped-call]
            version=API_VERSION, endpoint=endpoint, resource_name=resource,
            options=api.DevicePluginOptions(get_preferred_allocation_available=True)), timeout=timeout)
