"""`devinject device-plugin`: the node agent for Kubernetes.

One process runs `watch`'s loop (discovery, health with take-out/put-back, CDI specs in the spec dir) and,
for every kind it finds (or those asked for), a kubelet device plugin: a gRPC server on its own socket in
the kubelet's device-plugins directory, registered as a resource. Health reaches the kubelet from the same
published state as the specs, so a device `watch` takes out is `Unhealthy` in the stream in the same round.

The kubelet removes plugin sockets when it starts: a supervisor thread notices its socket being recreated
(or ours gone) and serves and registers again within `kubelet_poll` seconds. A kubelet that dies leaves its
socket behind and breaks the ListAndWatch streams: a resource whose stream ended is not ready until it is
registered again, which waits for something to listen on the kubelet's socket. Device IDs are PCI
addresses (an IMEX channel's `channel-N`: the resource `nvidia.com/imex-channel`, one device per channel),
so they are the same after a plugin restart, and the ledger is untouched by a restart.

The log (`kubectl logs`, at info) has one plain line for each thing the agent does: its start, waiting for
the kubelet (once, then every `WAIT_LOG_EVERY` seconds), each registration and how long it took, a kubelet
gone or restarted, a device's health changing in ListAndWatch, each Allocate, its stop.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace

import grpc

from devinject import __version__
from devinject.agent.health import HEALTHY, UNHEALTHY
from devinject.agent.metricsserver import MetricsServer, WaitingMetricsServer, serve_or_wait
from devinject.agent.mps import Daemon, MpsDaemons, MpsError
from devinject.agent.publishers import Round
from devinject.agent.watch import Watcher, WatchOptions
from devinject.cdi.identity import DeviceKey, QualifiedName, device_key, node_id_of, qualified
from devinject.cdi.model import DeviceNode
from devinject.core import jsonlite
from devinject.core.errors import DevinjectError, UsageError
from devinject.core.poduid import checked_pod_uid
from devinject.deviceplugin.allocation import HEALTHY as HEALTHY_NAME
from devinject.deviceplugin.allocation import UNHEALTHY as UNHEALTHY_NAME
from devinject.deviceplugin.allocation import PluginDevice
from devinject.deviceplugin.bookings import PluginBookings, held_by_claims
from devinject.deviceplugin.metrics import Metrics, serve
from devinject.deviceplugin.migstrategy import (
    MIG_STRATEGIES,
    MIXED,
    SINGLE,
    kind_of,
    mig_resource,
    offer_keys,
    partition_profiles,
    profile_of,
    single_mismatch,
    unnameable_profiles,
)
from devinject.deviceplugin.service import KUBELET_SOCKET, DevicePluginService, ResourceServer, ResourceState, register
from devinject.deviceplugin.sharing import SharingConfig, TimeSliced, replica_id, replicated
from devinject.discovery.channels import ChannelDevice
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.discovery.topology import Place, place_of
from devinject.nodestate.ledger import PLUGIN_PREFIX, plugin_booking_id
from devinject.nodestate.pluginrelease import UNKNOWN_POD_GRACE
from devinject.nodestate.profilefacts import write_time_slicing

log = logging.getLogger(__name__)

DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
HOOK_LOG = "/var/log/devinject/hook.log"  # the hook's default log, read under the host root
HOOK_LOG_TAIL = 64 << 10
WAIT_LOG_EVERY = 30.0  # seconds between "still waiting for the kubelet" lines (the poll is every second)
STREAM_SETTLE = 0.25  # seconds from a stream's end to the supervisor's look (a kubelet restarting, or not)
PROBE_TIMEOUT = 1.0  # seconds to connect to the kubelet's socket before registering


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


def stream_changes(resource: str, before: dict[str, PluginDevice], after: dict[str, PluginDevice]) -> list[str]:
    """One log line per device whose health (or presence) the next ListAndWatch list changes."""
    lines = []
    for device_id in sorted(set(before) | set(after)):
        old, new = before.get(device_id), after.get(device_id)
        if new is None:
            lines.append(f"{resource}: ListAndWatch: {device_id} removed")
        elif old is None or old.offered != new.offered:
            health = HEALTHY_NAME if new.offered else UNHEALTHY_NAME
            why = f" ({new.held})" if new.held and new.healthy else ""
            lines.append(f"{resource}: ListAndWatch: {device_id} {health}{why}" + ("" if old else " (new)"))
    return lines


# a device ID, its CDI name, where it sits, its nodes and those of them it shares (as the ledger books them)
Offer = tuple[str, QualifiedName, Place, tuple[str, ...], tuple[str, ...]]


def _ids(nodes: tuple[DeviceNode, ...]) -> tuple[str, ...]:
    return tuple(node_id_of(n) for n in nodes if n.major is not None and n.minor is not None)


def pci_offers(found: FoundDevice, host: Host) -> tuple[str, DeviceKey, list[Offer]]:
    """A PCI device's kind, key and what it offers: the device by its PCI address, or a partitioned GPU's
    partitions (MIG, AMD CPX), never the whole GPU. A partition shares the nodes its siblings use too (the
    parent GPU's node, shared capabilities), as the DRA driver books them."""
    kind = found.profile.kind
    place = place_of(host, found)
    if found.partitions:
        offers: list[Offer] = []
        for p in found.partitions:
            siblings = {n for other in found.partitions if other != p for n in _ids(other.nodes)}
            nodes = _ids(p.nodes)
            shared = tuple(n for n in nodes if n in siblings or n == nodes[0])
            offers.append((f"{found.address}-{p.key}", qualified(kind, p.name), place, nodes, shared))
    else:
        offers = [(found.address, qualified(kind, str(found.index)), place, _ids(found.nodes), ())]
    return kind, device_key(kind, found.address), offers


def channel_offers(channel: ChannelDevice) -> tuple[str, DeviceKey, list[Offer]]:
    """A channel's kind, key and its one offer: ID `channel-N` (the name NVIDIA's DRA driver gives IMEX
    channel N), CDI name `kind=N`; no PCIe place and no NUMA node (a place of its own: none is closer)."""
    device_id = f"channel-{channel.number}"
    kind = channel.profile.kind
    return kind, channel.key, [(device_id, qualified(kind, channel.name), Place(device_id, (device_id,), None, ""),
                                _ids((channel.node,)), ())]


@dataclass(frozen=True)
class PluginOptions:
    watch: WatchOptions
    plugin_dir: str = DEFAULT_PLUGIN_DIR
    resource_names: dict[str, str] = field(default_factory=dict)  # kind -> resource name (default: the kind)
    fallback: bool = True  # devices/mounts/envs in Allocate answers, for runtimes without CDI
    metrics_address: str | None = None  # host:port of /metrics, /healthz, /readyz
    kubelet_poll: float = 1.0
    # the kubelet's pod directories (a booking ends with its pod's); default: `pods` beside the plugin directory
    pods_dir: str | None = None
    ledger_poll: float = 0.5  # seconds between looks at the ledger, the kubelet's checkpoint and its pods
    pod_grace: float = UNKNOWN_POD_GRACE  # seconds a booking waits for the checkpoint to name its pod
    sharing: SharingConfig = field(default_factory=SharingConfig)  # time-slicing (deviceplugin/sharing.py)
    mig_strategy: str = SINGLE  # deviceplugin/migstrategy.py: single or mixed
    pod_uid: str | None = None  # the agent's pod (downward API): its sockets carry it (endpoint_for)

    def __post_init__(self) -> None:
        if self.mig_strategy not in MIG_STRATEGIES:
            raise UsageError(f"--mig-strategy {self.mig_strategy!r}: expected one of {', '.join(MIG_STRATEGIES)}")
        if self.mig_strategy == MIXED and self.sharing.resources:
            # the ledger books a device shared or not by its kind: a profile's MIG devices, never replicated,
            # would be booked as their time-sliced kind's, shared with a DRA claim's exclusive booking
            raise UsageError("--mig-strategy mixed: not with a sharing: section (time-slicing or MPS of "
                             f"{self.sharing.resources[0].name}); use single")
        for kind, name in self.resource_names.items() if self.mig_strategy == MIXED else ():
            if name.partition("/")[2].startswith("mig-"):  # two sockets, one resource: the kubelet keeps one
                raise UsageError(f"--resource-name {kind}={name}: under --mig-strategy mixed a MIG profile's "
                                 "resource is named so (<domain>/mig-<profile>); name it otherwise")

    def resource_of(self, kind: str) -> str:
        """The resource a kind is served as: --resource-name's, then renamed when time-sliced; a MIG profile's
        key (mixed) as `nvidia.com/mig-<profile>`."""
        profile = profile_of(kind)
        if profile is not None:
            return mig_resource(kind_of(kind), profile)
        resource = self.resource_names.get(kind, kind)
        return self.sharing.served_as(resource, kind)

    def time_sliced(self, kind: str) -> TimeSliced | None:
        """The time-slicing entry of a kind's resource, if it is time-sliced (a MIG profile's resource never is)."""
        if profile_of(kind) is not None:
            return None
        return self.sharing.time_sliced(self.resource_names.get(kind, kind), kind)


def endpoint_for(resource: str, pod_uid: str | None = None) -> str:
    """The plugin's socket name: `devinject-nvidia.com-gpu.sock`, or in a pod with its UID
    (`devinject-nvidia.com-gpu-<pod uid>.sock`): two pods of a rolling update each serve on their own, and
    the one stopping removes only its own."""
    if pod_uid is None:
        return "devinject-" + resource.replace("/", "-") + ".sock"
    return f"devinject-{resource.replace('/', '-')}-{checked_pod_uid(pod_uid)}.sock"


class DevicePluginAgent:
    """The device plugins of one node over `watch`'s loop; `node`: the node a command made (its roots checked),
    else the one the options describe (agent/watch.py)."""

    def __init__(self, opts: PluginOptions, node: Node | None = None) -> None:
        if opts.pod_uid is not None:
            checked_pod_uid(opts.pod_uid)  # before anything starts: it names the sockets
        self.opts = opts
        self.metrics = Metrics()
        self.watcher = Watcher(opts.watch, node=node)
        self.watcher.publishers.append(self._published)  # the stream to the kubelet
        hook_log = os.path.join(self.watcher.scanned.root, HOOK_LOG.lstrip("/"))
        self.metrics.hook_latency.set_function(lambda: last_hook_duration(hook_log) or math.nan)  # read at scrape
        self.states: dict[str, ResourceState] = {}  # by kind
        self.servers: dict[str, ResourceServer] = {}  # by kind
        self.registered: set[str] = set()  # kinds registered with the current kubelet
        self.stopping = threading.Event()
        # the supervisor's turn early, not at its next poll: a stream ended (in a rolling update, the old pod's
        # exit makes the kubelet drop the newer registration too; registered again at once, the gap is short)
        self.supervise_now = threading.Event()
        self.lock = threading.Lock()
        self.last_round = time.monotonic()
        self.health_seen: dict[str, str] = {}
        self.kubelet_identity: tuple[int, int] | None = None
        self.reported: set[str] = set()  # errors already logged (the supervisor retries every poll)
        self.gauged: set[tuple[str, str]] = set()  # (kind, health) pairs the devices gauge has shown
        self.started = threading.Event()  # the first round is published: the supervisor may start
        self.started_at = time.time()
        self.metrics_bound: str | None = None  # host:port /metrics listens on
        self.due: dict[str, tuple[float, str]] = {}  # kind -> since when (wall clock) and why it must register
        self.ever_registered: set[str] = set()
        self.waiting: tuple[str, float, float] | None = None  # what for, since, last said (monotonic)
        self.registering: str | None = None  # the kind whose Register call is on its way
        self.stream_lost = False  # that kind's stream of this registration ended before Register returned
        pods_dir = opts.pods_dir or os.path.join(os.path.dirname(opts.plugin_dir.rstrip("/")), "pods")
        self.bookings = PluginBookings(opts.watch.state_dir, opts.plugin_dir, pods_dir, grace=opts.pod_grace)
        self.base: dict[str, dict[str, PluginDevice]] = {}  # by kind: as the health loop published them
        self.held: dict[str, dict[str, str]] = {}  # by kind: device ID -> the DRA claim that holds it
        self.sliced_written: dict[str, int] | None = None  # the time-sliced kinds last recorded for the ledger
        gen = opts.watch.generate
        self.mps = MpsDaemons(opts.watch.state_dir, os.path.join(gen.root, (gen.driver_root or "/").lstrip("/")))
        self.mps_replicas: dict[str, str] = {}  # replica -> the holder of its MPS daemon, running now
        self.mig_said: set[str] = set()  # MIG strategy warnings, said once for the agent's life

    # --- from the health loop --------------------------------------------------------------------------
    def _published(self, watcher: Round) -> None:
        """After every spec write: each served kind's devices with their published health, and its spec."""
        self.last_round = time.monotonic()
        specs = {spec.kind: spec for spec in watcher.specs}
        by_kind = self._devices_by_kind(watcher)
        if self.opts.mig_strategy == SINGLE:
            self._say_single_mismatch(watcher)
        self._mps_round(watcher)
        changes: list[str] = []
        if not self.started.is_set():  # the first list the kubelet gets already leaves out what claims hold
            data = self.bookings.read()
            if data is not None:
                self.held = {kind: held_by_claims(data, devices) for kind, devices in by_kind.items()}
        with self.lock:
            self.base = by_kind
            for kind, devices in by_kind.items():  # a kind, or a MIG profile's key (deviceplugin/migstrategy.py)
                if self.opts.watch.generate.kinds and kind_of(kind) not in self.opts.watch.generate.kinds:
                    continue
                devices = self._with_held(kind, devices)
                state = self.states.get(kind)
                if state is None:
                    state = self.states[kind] = ResourceState(self.opts.resource_of(kind), kind)
                    self.metrics.served(kind_of(kind), state.resource, (HEALTHY, UNHEALTHY))
                    self.due.setdefault(kind, (time.time(), "it was found"))
                listed = state.devices
                if state.update(devices, specs.get(kind_of(kind))) and self.started.is_set():
                    changes += stream_changes(state.resource, listed, devices)
            for kind, state in self.states.items():
                if kind not in by_kind:  # every device of the kind is gone: an empty list, not a stale one
                    listed = state.devices
                    if state.update({}, None):
                        changes += stream_changes(state.resource, listed, {})
        for line in changes:
            log.info("%s", line)
        self._say_time_slicing(by_kind)
        if not self.started.is_set():
            self._say_started()
            self.started.set()

    def _devices_by_kind(self, watcher: Round) -> dict[str, dict[str, PluginDevice]]:
        """Each served kind's devices (a time-sliced kind's as their replicas) with their published health;
        the take-out, put-back, probe timeout and device gauges counted on the way."""
        by_kind: dict[str, dict[str, PluginDevice]] = {}
        counts: dict[tuple[str, str], int] = {}
        served = ([(pci_offers(f, watcher.host), self._offer_keys(f)) for f in watcher.found]
                  + [(channel_offers(c), [c.profile.kind]) for c in watcher.channels])
        for (kind, key, offers), keys in served:
            track = watcher.tracks.get(key)
            healthy = track is None or track.published == HEALTHY
            by_kind.setdefault(kind, {})  # a kind whose devices all went to MIG profiles' resources is still known
            for (device_id, cdi_name, place, nodes, shared), served_as in zip(offers, keys, strict=True):
                if served_as is not None:
                    by_kind.setdefault(served_as, {})[device_id] = PluginDevice(
                        device_id, cdi_name, healthy, place, nodes, shared)
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
        for kind, devices in by_kind.items():
            sliced = self.opts.time_sliced(kind)
            if sliced is not None and sliced.mps:  # MPS is for whole GPUs: a MIG instance is not offered
                devices = {i: d for i, d in devices.items() if not d.shared}
            if sliced is not None:  # each device as its replicas, with its health
                by_kind[kind] = replicated(devices, sliced.replicas)
        return by_kind

    def _offer_keys(self, found: FoundDevice) -> list[str | None]:
        """Under which served key each of a device's offers goes (deviceplugin/migstrategy.py); under mixed, a
        MIG device NVML gives no profile for, or one no resource name can take, is left out, said once per GPU."""
        kind = found.profile.kind
        if self.opts.mig_strategy == SINGLE or not found.partitions:
            return [kind] * max(1, len(found.partitions))
        gpu = self.watcher.scanned.gpu_facts(found)
        keys = offer_keys(self.opts.mig_strategy, kind, found.partitions, gpu)
        if None in keys and found.address not in self.mig_said:
            self.mig_said.add(found.address)
            unnameable = unnameable_profiles(found.partitions, gpu)
            unknown = keys.count(None) - sum(1 for p in partition_profiles(found.partitions, gpu) if p in unnameable)
            if unknown:
                log.warning("%s %s: NVML gives no profile for %d of its MIG devices (no NVML facts: --nvml, the "
                            "driver root's libnvidia-ml); under --mig-strategy mixed they are not offered", kind,
                            found.address, unknown)
            if unnameable:
                log.warning("%s %s: MIG profile %s is no resource name (%s); under --mig-strategy mixed its MIG "
                            "devices are not offered", kind, found.address, ", ".join(unnameable),
                            mig_resource(kind, unnameable[0]))
        return keys

    def _say_single_mismatch(self, watcher: Round) -> None:
        """Under single, once: a node NVIDIA's single strategy refuses (MIG beside whole GPUs, several
        profiles), served all the same."""
        by_kind: dict[str, tuple[int, list[str | None]]] = {}
        for found in watcher.found:
            if not any(p.kind == "mig" for p in found.partitions):
                whole, profiles = by_kind.get(found.profile.kind, (0, []))
                by_kind[found.profile.kind] = (whole + (not found.partitions), profiles)
                continue
            gpu = self.watcher.scanned.gpu_facts(found)  # asked once per rescan, as the specs' UUIDs ask it
            whole, profiles = by_kind.get(found.profile.kind, (0, []))
            by_kind[found.profile.kind] = (whole, profiles + partition_profiles(found.partitions, gpu))
        for kind, (whole, profiles) in sorted(by_kind.items()):
            problem = single_mismatch(kind, whole, profiles)
            if problem is not None and problem not in self.mig_said:
                self.mig_said.add(problem)
                log.warning("%s", problem)

    def _mps_round(self, watcher: Round) -> None:
        """One MPS control daemon per replica of a whole GPU of a resource shared through MPS (agent/mps.py:
        the driver root's nvidia-cuda-mps-control, on a tmpfs of its own), held as
        `device-plugin:<resource>:<replica>`: the kubelet hands a replica to one container at a time, so two
        pods never share a daemon, a pipe directory or a server. Started while the plugin serves the resource,
        started again when it died or its socket was replaced; a replica no longer served is released (its
        daemon stops). Left running when the plugin stops, as its clients are the pods' processes (a
        restarted plugin adopts it from daemons.json)."""
        wanted: dict[str, tuple[str, str, str]] = {}  # holder -> (replica, GPU, what CUDA_VISIBLE_DEVICES names it)
        for found in watcher.found:
            kind = found.profile.kind
            entry = self.opts.time_sliced(kind)
            if entry is None or not entry.mps or (self.opts.watch.generate.kinds
                                                  and kind not in self.opts.watch.generate.kinds):
                continue
            if found.partitions:
                self._say_once(logging.WARNING, "%s %s: split into MIG instances; MPS serves whole GPUs only, "
                               "so none of it is offered", kind, found.address)
                continue
            for k in range(entry.replicas):
                replica = replica_id(found.address, k)
                wanted[plugin_booking_id(self.opts.resource_of(kind), replica)] = (  # as its booking
                    replica, found.address, found.uuid or str(found.index))
        try:
            for gpu, holders in self.mps.recorded().items():
                for holder in holders:
                    if holder.startswith(PLUGIN_PREFIX) and wanted.get(holder, ("", ""))[1] != gpu:
                        self.mps.release(gpu, holder)
            recorded = {h for holders in self.mps.recorded().values() for h in holders}
            for holder, (replica, gpu, visible) in sorted(wanted.items()):
                if holder not in recorded:
                    self.mps.acquire(gpu, holder, visible)
                    log.info("%s: MPS control daemon of %s runs (%s)", holder.removeprefix(PLUGIN_PREFIX), replica,
                             self.mps.daemon(holder).pipe_dir)
            self.mps.check()
        except MpsError as err:
            self._say_once(logging.ERROR, "MPS: %s", err.message)
        running = {h for holders in self.mps.running().values() for h in holders}
        self.mps_replicas = {replica: holder for holder, (replica, _, _) in wanted.items() if holder in running}

    def mps_daemon(self, replica: str) -> Daemon | None:
        """The running MPS daemon serving the replica `replica` for this plugin, None when there is none."""
        holder = self.mps_replicas.get(replica)
        return self.mps.daemon(holder) if holder is not None else None

    def _say_time_slicing(self, by_kind: dict[str, dict[str, PluginDevice]]) -> None:
        """The kinds this plugin time-slices, in the state dir for the ledger (and the hook): a time-sliced
        device is booked shared, by at most its replicas' containers."""
        sliced = {kind: entry.replicas for kind in by_kind if (entry := self.opts.time_sliced(kind)) is not None
                  and (not self.opts.watch.generate.kinds or kind in self.opts.watch.generate.kinds)}
        if sliced == self.sliced_written:
            return
        try:
            write_time_slicing(self.opts.watch.state_dir, sliced, {k: self.opts.resource_of(k) for k in sliced})
        except (OSError, DevinjectError) as err:
            self._say_once(logging.ERROR, "%s: cannot record the time-sliced kinds: %s", self.opts.watch.state_dir,
                           getattr(err, "message", None) or getattr(err, "strerror", None) or err)
            return
        self.sliced_written = sliced
        for kind, replicas in sorted(sliced.items()):
            log.info("%s: each device time-sliced %d ways, offered as %s", kind, replicas, self.opts.resource_of(kind))

    def _with_held(self, kind: str, devices: dict[str, PluginDevice]) -> dict[str, PluginDevice]:
        held = self.held.get(kind, {})
        return {i: replace(d, held=held.get(i, "")) for i, d in devices.items()}

    # --- the other path: the node's ledger -------------------------------------------------------------
    def follow_ledger_once(self) -> None:
        """Learn and release the plugin's bookings, and offer a device a DRA claim holds as Unhealthy (healthy
        again once released), so that the kubelet's allocatable drops by it and the kubelet never picks it."""
        if not self.bookings.due(time.time()):
            return
        with self.lock:
            served = {state.resource: self.base.get(kind, {}) for kind, state in self.states.items()}
        self.bookings.reconcile(served)
        data = self.bookings.read()
        if data is None:
            return  # missing or broken: what claims hold is not known until it is rebuilt, so nothing changes
        changes: list[str] = []
        with self.lock:
            for kind, state in self.states.items():
                base = self.base.get(kind, {})
                held = held_by_claims(data, base)
                if held == self.held.get(kind, {}):
                    continue
                self.held[kind] = held
                listed = state.devices
                devices = self._with_held(kind, base)
                if state.update(devices, state.spec):
                    changes += stream_changes(state.resource, listed, devices)
        for line in changes:
            log.info("%s", line)

    def _follow_ledger(self) -> None:
        while not self.started.wait(0.5):
            if self.stopping.is_set():
                return
        while not self.stopping.is_set():
            try:
                self.follow_ledger_once()
            except Exception:  # the loop must outlive any one failure
                log.exception("device plugin bookings")
            if self.mps_replicas:  # a dead MPS daemon is started again within a poll, not at the next spec write
                try:
                    self.mps.check()
                except MpsError as err:
                    self._say_once(logging.ERROR, "MPS: %s", err.message)
            self.stopping.wait(self.opts.ledger_poll)

    def _book(self, resource: str, devices: list[PluginDevice]) -> None:
        self.bookings.book(resource, devices)

    def _held_now(self, devices: dict[str, PluginDevice]) -> dict[str, str]:
        data = self.bookings.read()
        return held_by_claims(data, devices) if data is not None else {}

    def _say_started(self) -> None:
        with self.lock:
            served = ", ".join(f"{s.resource} {len(s.devices)}" for _, s in sorted(self.states.items()))
        watch = self.opts.watch
        log.info("devinject %s device plugin on node %s: %s; specs in %s, state in %s, kubelet plugin dir %s, "
                 "metrics %s", __version__, os.environ.get("NODE_NAME") or os.uname().nodename,
                 served or "no devices found", watch.output_dir, watch.state_dir, self.opts.plugin_dir,
                 f"on {self.metrics_bound}" if self.metrics_bound else "off")

    # --- serving and registering -----------------------------------------------------------------------
    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.opts.plugin_dir, KUBELET_SOCKET))
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def _kubelet_socket(self) -> str:
        return os.path.join(self.opts.plugin_dir, KUBELET_SOCKET)

    def _kubelet_changed(self, before: tuple[int, int] | None, after: tuple[int, int] | None) -> None:
        """Its socket appeared, went or was made anew: every resource registers again."""
        path = self._kubelet_socket()
        with self.lock:
            self.registered.clear()
        if after is None:
            if before is not None:
                log.warning("kubelet socket %s is gone: not ready until the kubelet is back", path)
                self.waiting = ("socket", time.monotonic(), time.monotonic())
            return
        since, why = min(after[1] / 1e9, time.time()), "the kubelet socket appeared"  # made then (its ctime)
        if before is None and self.ever_registered:
            log.info("kubelet socket %s is back: registering again", path)
        elif before is not None:
            why = "the kubelet restarted"
            log.info("kubelet restarted (its socket %s was made anew): registering again", path)
        elif since < self.started_at:  # there before us (this agent's pod was restarted or updated)
            since, why = self.started_at, "the agent started"
        with self.lock:
            for kind in self.states:
                self.due[kind] = (since, why)

    def _wait(self, what: str, message: str, again: str) -> None:
        """Say what the agent waits for once, then every WAIT_LOG_EVERY seconds while it still does."""
        now = time.monotonic()
        if self.waiting is None or self.waiting[0] != what:
            log.info(message, self._kubelet_socket())
            self.waiting = (what, now, now)
        elif now - self.waiting[2] >= WAIT_LOG_EVERY:
            log.info(again, self._kubelet_socket(), now - self.waiting[1])
            self.waiting = (what, self.waiting[1], now)

    def _kubelet_listening(self) -> bool:
        """Something accepts connections on the kubelet's socket (a dead kubelet leaves its socket behind)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(PROBE_TIMEOUT)
            try:
                probe.connect(self._kubelet_socket())
            except OSError:
                return False
        return True

    def _say_once(self, level: int, message: str, *args: object) -> None:
        """What the supervisor would repeat every poll: said once until a registration succeeds."""
        text = message % args
        if text not in self.reported:
            self.reported.add(text)
            log.log(level, "%s", text)

    def supervise_once(self) -> None:
        """Serve every known resource and register it with the kubelet; again when the kubelet restarted
        (its socket recreated), its stream to us ended or our socket was removed."""
        identity = self._kubelet_identity()
        if identity != self.kubelet_identity:
            before, self.kubelet_identity = self.kubelet_identity, identity
            self._kubelet_changed(before, identity)
        if identity is None:
            self._wait("socket", "waiting for the kubelet socket %s",
                       "still waiting for the kubelet socket %s (%.0f s)")
            return
        with self.lock:
            states = dict(self.states)
        listening: bool | None = None
        for kind, state in states.items():
            server = self.servers.get(kind)
            if server is None:
                service = DevicePluginService(state, fallback=self.opts.fallback, stopping=self.stopping,
                                              on_allocate=self._allocated, on_stream_end=self._stream_ended,
                                              grant_dir=self.opts.watch.state_dir,
                                              book=self._book, held_now=self._held_now,
                                              beside_dra=self.bookings.beside_dra,
                                              fail_requests_greater_than_one=(
                                                  self.opts.sharing.fail_requests_greater_than_one
                                                  and self.opts.time_sliced(kind) is not None),
                                              mps=self.mps_daemon if (entry := self.opts.time_sliced(kind))
                                              is not None and entry.mps else None)
                server = ResourceServer(service, self.opts.plugin_dir, endpoint_for(state.resource, self.opts.pod_uid))
                self.servers[kind] = server
            if not server.alive():
                server.service.new_epoch()  # streams of the server it replaces are not this registration's
                try:
                    server.start()
                except OSError as err:
                    self._say_once(logging.ERROR, "%s: %s", state.resource, err)
                    continue
                if kind in self.registered:
                    with self.lock:
                        self.registered.discard(kind)
                    self.due[kind] = (time.time(), "its socket was removed")
            if kind in self.registered:
                continue
            if listening is None:
                listening = self._kubelet_listening()
            if not listening:
                self._wait("listener", "waiting for the kubelet: nothing listens on its socket %s",
                           "still waiting for the kubelet: nothing listens on its socket %s (%.0f s)")
                return
            self._register(kind, state, server)

    def _register(self, kind: str, state: ResourceState, server: ResourceServer) -> None:
        server.service.new_epoch()  # the kubelet opens its stream while Register is answered
        with self.lock:
            self.registering, self.stream_lost = kind, False
        try:
            register(self.opts.plugin_dir, server.endpoint, state.resource)
        except grpc.FutureTimeoutError:
            self._say_once(logging.WARNING, "%s: the kubelet did not answer on its socket; retrying", state.resource)
            return
        except grpc.RpcError as err:
            detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.Call) else str(err)
            self._say_once(logging.WARNING, "%s: the kubelet refused the registration (%s); retrying",
                           state.resource, detail)
            return
        finally:
            with self.lock:
                self.registering, lost = None, self.stream_lost
        if lost:  # its stream opened and ended while Register was answered: not registered after all
            self.ever_registered.add(kind)
            self._lost_stream(kind, state.resource)
            return
        with self.lock:
            self.registered.add(kind)
        self.reported.clear()
        self.waiting = None
        self.metrics.registrations.labels(state.resource).inc()
        since, why = self.due.pop(kind, (time.time(), "it was due"))
        again = " again" if kind in self.ever_registered else ""
        self.ever_registered.add(kind)
        log.info("%s: registered%s with the kubelet (%d devices, endpoint %s), %.2f s after %s", state.resource,
                 again, len(state.devices), server.endpoint, max(0.0, time.time() - since), why)

    def _stream_ended(self, kind: str) -> None:
        """From a server thread: the kubelet's ListAndWatch stream of this registration ended."""
        if self.stopping.is_set():
            return
        with self.lock:
            if kind == self.registering:
                self.stream_lost = True  # said when Register returns
                return
            if kind not in self.registered:
                return
            self.registered.discard(kind)
            resource = self.states[kind].resource
        self._lost_stream(kind, resource)

    def _lost_stream(self, kind: str, resource: str) -> None:
        self.due[kind] = (time.time(), "its ListAndWatch stream ended")
        log.warning("%s: the kubelet's ListAndWatch stream ended: not ready until registered again", resource)
        if self._kubelet_listening():
            # the kubelet lives on and dropped this registration (a rolling update's old plugin's stream ended):
            # registered again at once
            self.supervise_now.set()
            return
        # a kubelet going away or restarting: looked at again soon, not at the next poll, once it has made its
        # socket anew
        timer = threading.Timer(min(STREAM_SETTLE, self.opts.kubelet_poll), self.supervise_now.set)
        timer.daemon = True
        timer.start()

    def _allocated(self, resource: str, count: int | None) -> None:
        """`count` devices handed out, or None: a request refused."""
        if count is None:
            self.metrics.refusals.labels(resource).inc()
        else:
            self.metrics.allocations.labels(resource).inc(count)

    def _supervise(self) -> None:
        while not self.started.wait(0.5):  # the start-up line first, and the kinds it found
            if self.stopping.is_set():
                return
        while not self.stopping.is_set():
            try:
                self.supervise_once()
            except Exception:  # the supervisor must outlive any one failure
                log.exception("device plugin supervisor")
            self.supervise_now.wait(self.opts.kubelet_poll)
            self.supervise_now.clear()

    def alive(self) -> bool:
        """The health loop turned within three of its intervals."""
        return time.monotonic() - self.last_round < 3 * self.opts.watch.interval + self.opts.watch.rescan

    def ready(self) -> bool:
        """Every resource registered with the kubelet there now: not while its socket is gone, nothing listens
        on it or a resource's ListAndWatch stream ended, until registered again."""
        with self.lock:
            return bool(self.states) and set(self.states) <= self.registered

    def run(self, stop: threading.Event) -> None:
        http: MetricsServer | WaitingMetricsServer | None = None
        if self.opts.metrics_address:
            # in a pod, the pod a rolling update replaces may hold the port a while yet (the node's network)
            http = (serve_or_wait if self.opts.pod_uid else serve)(self.opts.metrics_address, self.metrics,
                                                                   self.alive, self.ready)
            host, port = http.server_address
            self.metrics_bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        supervisor = threading.Thread(target=self._supervise, name="kubelet", daemon=True)
        supervisor.start()
        follower = threading.Thread(target=self._follow_ledger, name="ledger", daemon=True)
        follower.start()
        try:
            self.watcher.run(stop)
        finally:
            self.stopping.set()
            self.supervise_now.set()
            supervisor.join(timeout=5)
            follower.join(timeout=5)
            for server in self.servers.values():
                server.close()  # no socket of ours left in the kubelet's directory once the agent is gone
            if http is not None:
                http.shutdown()
            served = sorted(server.service.state.resource for server in self.servers.values())
            log.info("stopped%s", f": {', '.join(served)} no longer served" if served else "")
