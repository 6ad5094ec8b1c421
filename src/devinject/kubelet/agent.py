"""`devinject device-plugin`: the node agent for Kubernetes.

One process runs `watch`'s loop (discovery, health with take-out/put-back, CDI specs in the spec dir) and,
for every kind it finds (or those asked for), a kubelet device plugin: a gRPC server on its own socket in
the kubelet's device-plugins directory, registered as a resource. Health reaches the kubelet from the same
published state as the specs, so a device `watch` takes out is `Unhealthy` in the stream in the same round.

The kubelet removes plugin sockets when it starts: a supervisor thread notices its socket being recreated
(or ours gone) and serves and registers again within `kubelet_poll` seconds. Device IDs are PCI addresses,
so they are the same after a plugin restart, and the ledger is untouched by a restart.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

import grpc

from devinject.agent.health import HEALTHY, UNHEALTHY
from devinject.agent.watch import Watcher, WatchOptions
from devinject.core import jsonlite
from devinject.core.identity import device_key, qualified
from devinject.discovery.topology import place_of
from devinject.kubelet.allocation import PluginDevice
from devinject.kubelet.metrics import Metrics, serve
from devinject.kubelet.server import KUBELET_SOCKET, DevicePluginService, ResourceServer, ResourceState, register

log = logging.getLogger(__name__)

DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
HOOK_LOG = "/var/log/devinject/hook.log"  # the hook's default log, read under the host root
HOOK_LOG_TAIL = 64 << 10


def last_hook_duration(path: str) -> float | None:
    """The newest prestart duration (ms) in the devinject hook's log, from its tail; None when unknown."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - HOOK_LOG_TAIL))
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = jsonlite.loads(line)
        except ValueError:
            continue  # the tail's first line is usually cut
        if isinstance(record, dict) and record.get("stage") == "prestart" and "duration_ms" in record:
            return float(record["duration_ms"])
    return None


@dataclass(frozen=True)
class PluginOptions:
    watch: WatchOptions
    plugin_dir: str = DEFAULT_PLUGIN_DIR
    resource_names: dict[str, str] = field(default_factory=dict)  # kind -> resource name (default: the kind)
    fallback: bool = True  # devices/mounts/envs in Allocate answers, for runtimes without CDI
    metrics_address: str | None = None  # host:port of /metrics, /healthz, /readyz
    kubelet_poll: float = 1.0


def endpoint_for(resource: str) -> str:
    """The plugin's socket name: `devinject-nvidia.com-gpu.sock`."""
    return "devinject-" + resource.replace("/", "-") + ".sock"


class DevicePluginAgent:
    def __init__(self, opts: PluginOptions) -> None:
        self.opts = opts
        self.metrics = Metrics()
        self.watcher = Watcher(opts.watch)
        self.watcher.listeners.append(self._published)
        hook_log = os.path.join(opts.watch.generate.root, HOOK_LOG.lstrip("/"))
        self.metrics.hook_latency.set_function(lambda: last_hook_duration(hook_log) or math.nan)  # read at scrape
        self.states: dict[str, ResourceState] = {}  # by kind
        self.servers: dict[str, ResourceServer] = {}  # by kind
        self.registered: set[str] = set()  # kinds registered with the current kubelet
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.last_round = time.monotonic()
        self.health_seen: dict[str, str] = {}
        self.kubelet_identity: tuple[int, int] | None = None
        self.reported: set[str] = set()  # errors already logged (the supervisor retries every poll)
        self.gauged: set[tuple[str, str]] = set()  # (kind, health) pairs the devices gauge has shown

    # --- from the health loop --------------------------------------------------------------------------
    def _published(self, watcher: Watcher) -> None:
        """After every spec write: each served kind's devices with their published health, and its spec."""
        self.last_round = time.monotonic()
        specs = {spec.kind: spec for spec in watcher.specs}
        by_kind: dict[str, dict[str, PluginDevice]] = {}
        counts: dict[tuple[str, str], int] = {}
        for found in watcher.found:
            kind = found.profile.kind
            key = device_key(kind, found.address)
            track = watcher.tracks.get(key)
            healthy = track is None or track.published == HEALTHY
            place = place_of(watcher.host, found)
            offered = by_kind.setdefault(kind, {})
            if found.partitions:  # a partitioned GPU (MIG, AMD CPX): its partitions, never the whole GPU
                for part in found.partitions:
                    part_id = f"{found.address}-{part.key}"
                    offered[part_id] = PluginDevice(part_id, qualified(kind, part.name), healthy, place)
            else:
                offered[found.address] = PluginDevice(found.address, qualified(kind, str(found.index)), healthy,
                                                      place)
            health = HEALTHY if healthy else UNHEALTHY
            counts[(kind, health)] = counts.get((kind, health), 0) + 1
            before = self.health_seen.get(key)
            if before is not None and before != health:
                (self.metrics.take_outs if health == UNHEALTHY else self.metrics.put_backs).labels(kind).inc()
            self.health_seen[key] = health
            if track is not None and track.last is not None and any("timed out" in r for r in track.last.reasons):
                self.metrics.probe_timeouts.labels(kind).inc()
        for kind, health in set(counts) | self.gauged:  # set, never cleared: a scrape must not see a gap
            self.metrics.devices.labels(kind, health).set(counts.get((kind, health), 0))
        self.gauged |= set(counts)
        with self.lock:
            for kind, devices in by_kind.items():
                if self.opts.watch.generate.kinds and kind not in self.opts.watch.generate.kinds:
                    continue
                state = self.states.get(kind)
                if state is None:
                    state = self.states[kind] = ResourceState(self.opts.resource_names.get(kind, kind), kind)
                state.update(devices, specs.get(kind))
            for kind, state in self.states.items():
                if kind not in by_kind:  # every device of the kind is gone: an empty list, not a stale one
                    state.update({}, None)

    # --- serving and registering -----------------------------------------------------------------------
    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.opts.plugin_dir, KUBELET_SOCKET))
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def supervise_once(self) -> None:
        """Serve every known resource and register it with the kubelet; again when the kubelet restarted
        (its socket recreated) or our socket was removed."""
        identity = self._kubelet_identity()
        if identity != self.kubelet_identity:
            if self.kubelet_identity is not None:
                log.info("kubelet socket %s: registering again", "recreated" if identity else "gone")
            self.kubelet_identity = identity
            self.registered.clear()
        if identity is None:
            return
        with self.lock:
            states = dict(self.states)
        for kind, state in states.items():
            server = self.servers.get(kind)
            if server is None:
                service = DevicePluginService(state, fallback=self.opts.fallback, stopping=self.stopping,
                                              on_allocate=self._allocated)
                server = ResourceServer(service, self.opts.plugin_dir, endpoint_for(state.resource))
                self.servers[kind] = server
            if not server.alive():
                try:
                    server.start()
                except OSError as err:
                    if str(err) not in self.reported:
                        self.reported.add(str(err))
                        log.error("%s: %s", state.resource, err)
                    continue
                self.registered.discard(kind)
            if kind in self.registered:
                continue
            try:
                register(self.opts.plugin_dir, server.endpoint, state.resource)
            except grpc.FutureTimeoutError:
                log.warning("%s: the kubelet did not answer on its socket; retrying", state.resource)
                continue
            except grpc.RpcError as err:
                log.warning("%s: the kubelet refused the registration (%s); retrying", state.resource, err)
                continue
            self.registered.add(kind)
            self.metrics.registrations.labels(state.resource).inc()
            log.info("%s: registered with the kubelet (endpoint %s, %d devices)", state.resource, server.endpoint,
                     len(state.devices))

    def _allocated(self, resource: str, count: int | None) -> None:
        """`count` devices handed out, or None: a request refused."""
        if count is None:
            self.metrics.refusals.labels(resource).inc()
        else:
            self.metrics.allocations.labels(resource).inc(count)

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            try:
                self.supervise_once()
            except Exception:  # the supervisor must outlive any one failure
                log.exception("device plugin supervisor")
            self.stopping.wait(self.opts.kubelet_poll)

    def alive(self) -> bool:
        """The health loop turned within three of its intervals."""
        return time.monotonic() - self.last_round < 3 * self.opts.watch.interval + self.opts.watch.rescan

    def ready(self) -> bool:
        with self.lock:
            return bool(self.states) and set(self.states) <= self.registered

    def run(self, stop: threading.Event) -> None:
        http = None
        if self.opts.metrics_address:
            http = serve(self.opts.metrics_address, self.metrics, self.alive, self.ready)
        supervisor = threading.Thread(target=self._supervise, name="kubelet", daemon=True)
        supervisor.start()
        try:
            self.watcher.run(stop)
        finally:
            self.stopping.set()
            supervisor.join(timeout=5)
            for server in self.servers.values():
                server.stop()
            if http is not None:
                http.shutdown()
