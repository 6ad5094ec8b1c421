"""The kubelet's side of the DRA driver over gRPC on unix sockets: the plugin registration service
(`pluginregistration.Registration`, on `<registry dir>/<driver>-reg.sock`, which the kubelet watches) and the
DRA service (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`) with resource health (`v1` and `v1alpha1`
`DRAResourceHealth`, both advertised in the registration: a 1.37 kubelet opens a stream only for a health
service the plugin advertises) on `<plugins dir>/<driver>/dra.sock`.

Run in a pod (`--pod-uid`), the sockets carry the pod's UID, as the kubelet plugin library's RollingUpdate names
them (`<driver>-<uid>-reg.sock`, `<driver>/dra-<uid>.sock`): a 1.33+ kubelet then keeps both pods of a rolling
update registered and sends new calls to the newest, so a DaemonSet can surge (`maxSurge: 1, maxUnavailable: 0`)
with no moment in which the node has no driver. Each pod removes only its own sockets when it stops."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from devinject.core.errors import DevinjectError
from devinject.core.poduid import checked_pod_uid
from devinject.dra.api import dra_v1_pb2 as dra
from devinject.dra.api import dra_v1_pb2_grpc as dra_grpc
from devinject.dra.api import health_v1_pb2 as health_v1
from devinject.dra.api import health_v1_pb2_grpc as health_v1_grpc
from devinject.dra.api import health_v1alpha1_pb2 as health_alpha
from devinject.dra.api import health_v1alpha1_pb2_grpc as health_alpha_grpc
from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devinject.dra.claims import PreparedDevice, Preparer
from devinject.dra.metrics import DraMetrics, error_reason

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# the DRA service's version, then the health services' (a 1.37 kubelet prefers v1, else v1alpha1; 1.36 opens
# v1alpha1 whatever is advertised and ignores the strings it does not know)
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL
HEALTH_POLL = 1.0
# each device's health_check_timeout_seconds: a verdict older than this is UNKNOWN to the kubelet, so every
# stream sends the whole list again every HEALTH_RESEND s though nothing changed (a third of it: two late)
HEALTH_TIMEOUT_SECONDS = 30
HEALTH_RESEND = 10.0
MAX_HEALTH_MESSAGE = 1024  # characters of DeviceHealth.message
MAX_HEALTH_STREAMS = 4  # NodeWatchResources streams at once (the kubelet keeps one): each holds a worker
PREPARE_WORKERS = 8  # what prepares and unprepares always have, however many streams are open
SOCKET_MODE = 0o600  # the kubelet (root) alone dials the sockets: whoever can may unprepare any claim
DIR_MODE = 0o750
MIN_TIME_LEFT = 1.0  # seconds of the kubelet's deadline a claim needs to be attempted
Prepared = Callable[[str, str, str, list[PreparedDevice]], None]  # (namespace, name, uid, its devices)
Unprepared = Callable[[str, str, str], None]


def socket_names(driver: str, pod_uid: str | None) -> tuple[str, str]:
    """The registration socket's and the DRA service socket's file names: fixed for a driver run on the host,
    with the pod's UID in both for one run in a pod (two pods of one driver overlap during a rolling update)."""
    if pod_uid is None:
        return f"{driver}-reg.sock", "dra.sock"
    uid = checked_pod_uid(pod_uid)
    return f"{driver}-{uid}-reg.sock", f"dra-{uid}.sock"


def claim_error(err: Exception, doing: str, claim: Any) -> str:
    """The one line a claim's entry answers with. A DevinjectError is a claim's expected failure; any other
    is a bug (a hostile input no parser caught): its traceback logged, the claim still answered, and every
    other claim of the call still prepared and answered (the kubelet otherwise gets UNKNOWN for all of them,
    and a claim prepared on the node is never told to the kubelet)."""
    if isinstance(err, DevinjectError):
        return err.message
    log.error("claim %s/%s (%s): %s failed unexpectedly", claim.namespace, claim.name, claim.uid, doing,
              exc_info=err)
    said = " ".join(str(err).split())[:200]
    return (f"internal error in devinject's {doing}: {type(err).__name__}{': ' + said if said else ''} (a bug: "
            "the driver's log has its traceback)")


class DraService(dra_grpc.DRAPluginServicer):
    """Each claim is prepared on its own: one failing claim is an error in its entry, never the whole call's."""

    def __init__(self, preparer: Preparer, metrics: DraMetrics | None = None, prepared: Prepared | None = None,
                 unprepared: Unprepared | None = None) -> None:
        self.preparer = preparer
        self.metrics = metrics or DraMetrics()
        self.prepared, self.unprepared = prepared, unprepared  # told after each claim (its status is written)

    def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> dra.NodePrepareResourcesResponse:
        response = dra.NodePrepareResourcesResponse()
        metrics = self.metrics
        for claim in request.claims:
            entry = response.claims[claim.uid]
            metrics.prepares.inc()
            left = context.time_remaining()
            if left is not None and left < MIN_TIME_LEFT:
                # answered in time for the claims done, instead of the kubelet's deadline passing for all
                entry.error = f"not attempted: {left:.1f}s left of the kubelet's deadline (it calls again)"
                metrics.prepare_errors.labels("deadline").inc()
                continue
            started = time.monotonic()
            try:
                devices = self.preparer.prepare(claim.namespace, claim.name, claim.uid)
                for device in devices:
                    answer = dra.Device(request_names=list(device.requests), pool_name=device.pool,
                                        device_name=device.device, cdi_device_ids=list(device.cdi_ids))
                    if device.share_id is not None:  # the kubelet keys a shared device's allocation by it
                        answer.share_id = device.share_id
                    entry.devices.append(answer)
                if self.prepared is not None:
                    _told(self.prepared, claim.namespace, claim.name, claim.uid, devices)
            except Exception as err:  # a bug's error too is this claim's, never the call's
                message = claim_error(err, "prepare", claim)
                log.warning("claim %s/%s (%s): not prepared: %s", claim.namespace, claim.name, claim.uid, message)
                del entry.devices[:]
                entry.error = message
                metrics.prepare_errors.labels(error_reason(err)).inc()
            finally:
                metrics.prepare_seconds.observe(time.monotonic() - started)
        return response

    def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> dra.NodeUnprepareResourcesResponse:
        response = dra.NodeUnprepareResourcesResponse()
        metrics = self.metrics
        for claim in request.claims:
            entry = response.claims[claim.uid]
            metrics.unprepares.inc()
            started = time.monotonic()
            try:
                self.preparer.unprepare(claim.uid)
                if self.unprepared is not None:
                    _told(self.unprepared, claim.namespace, claim.name, claim.uid)
            except Exception as err:  # a bug's error too is this claim's, never the call's
                message = claim_error(err, "unprepare", claim)
                log.warning("claim %s/%s (%s): not unprepared: %s", claim.namespace, claim.name, claim.uid,
                            message)
                entry.error = message
                metrics.unprepare_errors.labels(error_reason(err)).inc()
            finally:
                metrics.unprepare_seconds.observe(time.monotonic() - started)
        return response


def _told(listener: Callable[..., None], namespace: str, name: str, uid: str, *more: Any) -> None:
    """A listener told of a claim done: whatever it fails at is logged, never the claim's answer."""
    try:
        listener(namespace, name, uid, *more)
    except Exception:
        log.exception("claim %s/%s (%s): after its call", namespace, name, uid)


class HealthBroadcast:
    """(pool, device) -> healthy, as the health loop last said; every stream sees each change."""

    def __init__(self) -> None:
        self.devices: dict[tuple[str, str], tuple[bool, str]] = {}
        self.version = 0
        self.changed = threading.Condition()

    def update(self, devices: dict[tuple[str, str], tuple[bool, str]]) -> None:
        with self.changed:
            if devices != self.devices:
                self.devices = dict(devices)
                self.version += 1
                self.changed.notify_all()

    def snapshot(self) -> tuple[int, dict[tuple[str, str], tuple[bool, str]]]:
        with self.changed:
            return self.version, dict(self.devices)

    def wait(self, seen: int, timeout: float) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen, timeout=timeout)


class HealthService:
    """`DRAResourceHealth.NodeWatchResources` of one API version (`api`: its generated module, v1 or v1alpha1:
    the same messages): the complete list, then again on every change and every HEALTH_RESEND s."""

    def __init__(self, api: Any, state: HealthBroadcast, stopping: threading.Event,
                 streams: threading.BoundedSemaphore | None = None) -> None:
        self.api, self.state, self.stopping = api, state, stopping
        # shared by both API versions' services: streams beyond it are refused, never queued on the workers
        self.streams = streams if streams is not None else threading.BoundedSemaphore(MAX_HEALTH_STREAMS)

    def _message(self, devices: dict[tuple[str, str], tuple[bool, str]]) -> Any:
        api, now = self.api, int(time.time())
        return api.NodeWatchResourcesResponse(devices=[api.DeviceHealth(
            device=api.DeviceIdentifier(pool_name=pool, device_name=name),
            health=api.HEALTHY if ok else api.UNHEALTHY, last_updated_time=now,
            health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS, message=one_line(reason))
            for (pool, name), (ok, reason) in sorted(devices.items())])

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if not self.streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{MAX_HEALTH_STREAMS} NodeWatchResources streams are open already")
        try:
            seen, sent = -1, 0.0
            while context.is_active() and not self.stopping.is_set():
                version, devices = self.state.snapshot()
                if version != seen or time.monotonic() - sent >= HEALTH_RESEND:
                    seen, sent = version, time.monotonic()
                    yield self._message(devices)
                self.state.wait(seen, HEALTH_POLL)
        finally:
            self.streams.release()


def one_line(reason: str) -> str:
    """A device's fault as the kubelet shows it in pod status: one line, at most MAX_HEALTH_MESSAGE characters."""
    return " ".join(reason.split())[:MAX_HEALTH_MESSAGE]


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = threading.Event()
        self.error = ""

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(type=PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint,
                              supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("%s: registered with the kubelet", self.driver)
            self.error = ""
            self.registered.set()
        else:
            log.warning("%s: the kubelet refused the registration: %s", self.driver, request.error)
            self.error = request.error
            self.registered.clear()
        return reg.RegistrationStatusResponse()


def serve(path: str, add: Callable[[grpc.Server], None], workers: int = 4) -> grpc.Server:
    """A gRPC server on the unix socket `path` (an old socket there is replaced), mode 0600 whatever the umask,
    in a directory made 0750 (every one made) or checked as the hook server checks its own: a real directory
    owned by root (this user) that nobody else can write, so nobody else can put a socket in its place."""
    from devinject.linux.trusteddir import trusted_dir

    if len(path.encode()) > MAX_SOCKET_PATH:
        raise DevinjectError(f"{path}: too long for a unix socket ({MAX_SOCKET_PATH} bytes at most)")
    trusted_dir(os.path.dirname(path), DIR_MODE, what="socket directory")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dra"))
    add(server)
    try:
        server.add_insecure_port(f"unix://{path}")
        os.chmod(path, SOCKET_MODE)  # bound under the umask; before the server serves anyone
    except RuntimeError:
        raise DevinjectError(f"{path}: cannot listen on this socket") from None
    except OSError as err:
        server.stop(None)
        raise DevinjectError(f"{path}: cannot set the socket's mode: {err.strerror}") from None
    server.start()
    return server


class PluginServers:
    """Both sockets: the DRA service first (the kubelet dials it as soon as registration answers)."""

    def __init__(self, driver: str, preparer: Preparer, plugin_dir: str, registry_dir: str,
                 health: HealthBroadcast | None = None, metrics: DraMetrics | None = None,
                 prepared: Prepared | None = None, unprepared: Unprepared | None = None,
                 pod_uid: str | None = None) -> None:
        self.driver = driver
        registration, service = socket_names(driver, pod_uid)
        self.endpoint = os.path.join(plugin_dir, driver, service)
        self.registration_path = os.path.join(registry_dir, registration)
        self.stopping = threading.Event()
        self.health = health or HealthBroadcast()
        self.dra_service = DraService(preparer, metrics, prepared, unprepared)
        self.registration = RegistrationService(driver, self.endpoint)
        self.servers: list[grpc.Server] = []

    def start(self) -> None:
        streams = threading.BoundedSemaphore(MAX_HEALTH_STREAMS)

        def add_dra(server: grpc.Server) -> None:
            dra_grpc.add_DRAPluginServicer_to_server(self.dra_service, server)  # type: ignore[no-untyped-call]
            health_v1_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
                HealthService(health_v1, self.health, self.stopping, streams), server)
            health_alpha_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
                HealthService(health_alpha, self.health, self.stopping, streams), server)

        # the streams' workers on top of the prepares': open streams never leave a prepare waiting
        self.servers.append(serve(self.endpoint, add_dra, workers=PREPARE_WORKERS + MAX_HEALTH_STREAMS))
        self.servers.append(serve(self.registration_path, lambda s: reg_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            self.registration, s)))

    def stop(self, grace: float = 1.0) -> None:
        self.stopping.set()
        for server in self.servers:
            server.stop(grace).wait(grace + 1)
        self.servers = []
        for path in (self.registration_path, self.endpoint):
            try:
                os.unlink(path)  # the kubelet deregisters a plugin whose registration socket is gone
            except OSError:
                pass
