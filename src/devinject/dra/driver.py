"""`devinject dra-driver`: the DRA kubelet plugin and ResourceSlice publisher for one node (docs/dra.md).

The node's health is judged by `watch`'s loop (agent/watch.py's Watcher: the same checks, take-outs,
put-backs and persisted state as the device plugin's), run in this process on a thread of its own, writing
no CDI spec of its own (`WatchOptions.specs`): only health.json and health-state.json in the state dir. One
loop per state dir (`healthstate.take_loop_lock`): with `health="auto"` the driver runs it unless another
agent's loop (`watch`, `device-plugin`) holds the state dir, and then follows the health.json that one
writes, taking the loop over when it is free; `follow` never runs one, `check` insists.

Every `rescan` seconds the node is discovered again as `watch` rescans it (discovery/node.py
`Node.rescanned`: the host read again, the profiles loaded once when the driver was made) and its offers
(dra/slices.py) published when they changed; a verdict of the loop (told through its listener) is published
at once, from the offers discovered last. A device the loop took out stays in its slice with a
taint per fault (`<driver>/xid`, `/aer-fatal`, `/unbound`, `/gone`, ...: agent/health.py `faults_of`),
`NoSchedule`, or `NoExecute` for a fatal fault when `fatal_effect` says so, and is unhealthy in the health
stream the kubelet watches; put back, the taints go. A device that leaves discovery while taken out (off
the bus, unbound) is kept as it was last described, tainted, as long as the driver runs. An IMEX channel (a
char node, no PCI function) is judged by its node as `health` judges it (discovery/channels.py
channel_fault) too. Claims are prepared by dra/claims.py.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from devinject import __version__
from devinject.agent import healthstate
from devinject.agent.health import faults_of
from devinject.agent.metricsserver import MetricsServer, WaitingMetricsServer, serve, serve_or_wait
from devinject.agent.publishers import Round
from devinject.agent.watch import Watcher, WatchOptions, watched_node
from devinject.cdi.identity import device_key, node_id_of, path_identity
from devinject.core.errors import DevinjectError
from devinject.core.paths import DEFAULT_STATE_DIR, DYNAMIC_SPEC_DIR
from devinject.discovery.channels import channel_fault
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.dra.capacity import CapacitySharing
from devinject.dra.claims import ClaimReadError, Contest, Inventory, PreparedDevice, Preparer, allocated
from devinject.dra.claimstatus import StatusDevice, StatusWriter
from devinject.dra.devicemetadata import MetadataFiles
from devinject.dra.kubeletplugin import HealthBroadcast, PluginServers
from devinject.dra.metrics import DraMetrics
from devinject.dra.slices import (
    DRIVER,
    NO_EXECUTE,
    NO_SCHEDULE,
    Offer,
    Taint,
    label,
    label_value,
    offers,
    resource_slices,
    shareable,
)
from devinject.nodestate import healthverdicts
from devinject.nodestate.clashrule import clashes, describe
from devinject.nodestate.healthverdicts import HEALTH_FILE
from devinject.nodestate.ledger import LEDGER_FILE, Ledger, LedgerEntry, held_nodes, is_plugin
from devinject.nodestate.statefile import StateFileError
from devinject.specs.generate import GenerateOptions, driver_version

log = logging.getLogger(__name__)

HEALTH_MODES = ("auto", "check", "follow")
HELD_CAUSE = "held-by-device-plugin"  # the taint on a device the plugin holds that a claim was allocated on
TAKEN_OUT = "taken out by the node's health checks"  # a device health.json names by its nodes alone


class SliceApi(Protocol):
    """The API server as the driver uses it: publishes the node's ResourceSlices, reads a claim (not
    agent/publishers.py's RoundPublisher, which is told each rescan's result)."""

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]: ...
    def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


@runtime_checkable
class StatusApplier(Protocol):
    """A publisher that can write a claim's status (the API server's; a test's may not)."""

    def apply_claim_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class GroupReader(Protocol):
    """A publisher that can list a PodGroup's pods on this node (the API server's; a test's may not)."""

    def group_pods(self, namespace: str, group: str) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class DraOptions:
    generate: GenerateOptions
    node_name: str
    driver: str = DRIVER
    plugin_dir: str = "/var/lib/kubelet/plugins"
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = DYNAMIC_SPEC_DIR
    state_dir: str = DEFAULT_STATE_DIR
    rescan: float = 30.0
    metrics_address: str | None = None  # host:port of /metrics, /healthz, /readyz (dra/metrics.py)
    health: str = "auto"  # auto | check | follow: whether this process runs the node's health loop
    watch: WatchOptions | None = None  # the loop's timings and kernel log (default: watch's, over `generate`)
    fatal_effect: str = NO_SCHEDULE  # the taints' effect for a fatal fault: NoSchedule or NoExecute
    ledger_poll: float = 0.5  # seconds between looks at the ledger (the device plugin's bookings)
    capacity: CapacitySharing | None = None  # consumable capacity offered (dra/capacity.py); None: not
    contest_check: float = 5.0  # seconds between reads of the claims refused on a held device, while any is
    nfd_features_dir: str | None = None  # write NFD's feature file there (agent/nfd.py), as `watch` does
    device_metadata: bool = False  # KEP-5304's files for the claims' containers (dra/devicemetadata.py)
    # the kubelet's pod directories (a device-plugin booking whose pod is gone is released here too:
    # nodestate/pluginrelease.py); default: `pods` beside the plugin directory
    pods_dir: str | None = None
    pod_uid: str | None = None  # the driver's pod (downward API): its sockets carry it (dra/kubeletplugin.py)

    def watch_options(self) -> WatchOptions:
        """The health loop's options: this driver's node, state dir and rescan; no CDI spec of its own, and no
        feature file (the driver writes it, whether it runs the loop or follows another agent's)."""
        base = self.watch or WatchOptions(generate=self.generate, rescan=self.rescan)
        return replace(base, generate=self.generate, state_dir=self.state_dir, specs=False, nfd_features_dir=None)


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """What the node's health loop published (health.json): the nodes taken out, and each taken-out
    device's reasons by its key."""

    nodes: frozenset[str] = frozenset()
    reasons: dict[str, tuple[str, ...]] = field(default_factory=dict)


def read_health(state_dir: str) -> NodeHealth:
    """health.json as the loop wrote it (nodestate/healthverdicts.py); nothing out when no loop writes it.
    StateFileError naming the file and field when it cannot be believed (the driver then keeps the taints it
    read last, and the ledger refuses every booking)."""
    verdicts = healthverdicts.read(state_dir)
    if verdicts is None:
        return NodeHealth()
    return NodeHealth(frozenset(verdicts.unhealthy_nodes), verdicts.taken_out())


def offer_key(offer: Offer) -> str:
    """The health loop's key of the device an offer stands for (a partition: its GPU's)."""
    return offer.channel.key if offer.channel is not None else device_key(offer.kind, offer.device.address)


def fault_reasons(host: Host | None, offer: Offer, health: NodeHealth) -> tuple[str, ...]:
    """Why the offer is out (empty: it is not): a channel whose node is gone or not its own; a device the
    health loop took out, with its reasons."""
    fault = channel_fault(host, offer.channel) if offer.channel is not None and host is not None else None
    if fault is not None:
        return (fault,)
    key = offer_key(offer)
    if key in health.reasons:
        return health.reasons[key] or (TAKEN_OUT,)
    if any(node_id_of(n) in health.nodes for n in offer.nodes):
        return (TAKEN_OUT,)
    return ()


def taints_for(driver: str, reasons: tuple[str, ...], fatal_effect: str,
               since: Callable[[str], str]) -> tuple[Taint, ...]:
    """One taint per fault the reasons name: key `<driver>/<cause>`, the detail as value; NoSchedule, or
    `fatal_effect` for a fatal fault. `since(key)`: the taint's timeAdded."""
    taints = []
    for fault in faults_of(reasons):
        key = f"{driver}/{label(fault.cause)[:63].strip('-') or 'fault'}"
        effect = fatal_effect if fault.fatal else NO_SCHEDULE
        taints.append(Taint(key, label_value(fault.detail), effect, since(key)))
    return tuple(taints)


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def offer_holding(offer: Offer, policy: dict[str, str]) -> tuple[set[str], set[str]]:
    """The nodes a claim on `offer` would book (exclusive, shared), as the preparer books them: a partition
    shares the nodes its siblings use (its parent GPU's), a kind whose profile shares every device shares
    them all."""
    nodes: set[str] = {node_id_of(n) for n in offer.nodes if n.major is not None and n.minor is not None}
    if policy.get(offer.kind, "exclusive") == "shared":
        return set(), set(nodes)
    if offer.partition is None:
        return set(nodes), set()
    siblings = {node_id_of(n) for p in offer.device.partitions if p != offer.partition for n in p.nodes
                if n.major is not None and n.minor is not None}
    first = offer.partition.nodes[0]
    shared = {n for n in nodes if n in siblings or (first.major is not None and n == node_id_of(first))}
    return nodes - shared, shared


@dataclass(frozen=True, slots=True)
class PluginHolding:
    """Who holds an offer through the device plugin: the plugin's resource (`nvidia.com/gpu`) and a line
    for a person (ledger.describe)."""

    resource: str
    who: str


def plugin_held(allocations: Mapping[str, LedgerEntry], offered: list[Offer],
                policy: dict[str, str]) -> dict[tuple[str, str], PluginHolding]:
    """(pool, device) -> who holds it through the device plugin: the offers a claim could not be prepared on
    now, left out of the slices so that the scheduler places claims elsewhere."""
    held = held_nodes(allocations, is_plugin)
    if not held[0] and not held[1]:
        return {}
    plugin = {cid: e for cid, e in allocations.items() if is_plugin(e)}
    out: dict[tuple[str, str], PluginHolding] = {}
    for offer in offered:
        exclusive, shared = offer_holding(offer, policy)
        if not clashes(exclusive, shared, held):
            continue
        for cid, entry in plugin.items():
            if clashes(exclusive, shared, (set(entry.exclusive), set(entry.shared))):
                out[(offer.pool, offer.name)] = PluginHolding(str(entry.plugin), describe(cid, entry))
                break
    return out


def contested_devices(contests: dict[str, Contest]) -> dict[tuple[str, str], str]:
    """(pool, device) -> the first claim (`namespace/name`) refused on it, of the contests given."""
    out: dict[tuple[str, str], str] = {}
    for uid in sorted(contests):
        contest = contests[uid]
        for device in contest.devices:
            out.setdefault(device, f"{contest.namespace}/{contest.name}")
    return out


def contested_offers(published: list[Offer], held: dict[tuple[str, str], PluginHolding],
                     contested: dict[tuple[str, str], str], driver: str,
                     since: Callable[[Offer], Callable[[str], str]]) -> list[Offer]:
    """The offers for the slices: a device the device plugin holds leaves them, unless a claim allocated on
    this node points at it (`contested`: the scheduler allocated it in the instant the plugin's Allocate booked
    it, and the claim's prepare was refused). Such a device stays, with a `NoExecute` taint
    `<driver>/held-by-device-plugin` (value: the plugin's resource): the scheduler places nothing more on it,
    and kube-controller-manager's device-taint eviction deletes the claim's pod, whose controller makes a new
    pod and claim that land on a free device. Without the taint the pod would wait in ContainerCreating until
    the plugin's pod is gone: the scheduler never moves an allocated claim."""
    out = []
    for offer in published:
        key = (offer.pool, offer.name)
        holding = held.get(key)
        if holding is None:
            out.append(offer)
        elif key in contested:
            taint_key = f"{driver}/{HELD_CAUSE}"
            taint = Taint(taint_key, label_value(holding.resource), NO_EXECUTE, since(offer)(taint_key))
            out.append(replace(offer, taints=(*offer.taints, taint)))
    return out


def contest_stands(claim: Mapping[str, Any] | None, uid: str, driver: str, contest: Contest) -> bool:
    """Whether a claim refused on a held device still points at one of its devices: False when the API says
    it is gone (None), is another object (deleted and made again), is no longer allocated, or is allocated on
    none of them."""
    if claim is None:
        return False
    try:
        results = allocated(claim, driver, contest.namespace, contest.name, uid)
    except DevinjectError:
        return False
    return bool({(pool, device) for _, pool, device in results} & set(contest.devices))


@dataclass
class DriverState:
    """Everything of the driver's that changes while it runs, in one place: what discovery found (read by the
    kubelet's calls, the rescan and the health loop's listener, under `lock`), what was published and the
    taints' times (the publishing round's, under `publishing`), health.json as read last, the signals between
    the threads, and the health loop this process runs."""

    node: Node  # as the last rescan read it; its profiles loaded once, kept by every rescan
    lock: threading.Lock = field(default_factory=threading.Lock)
    publishing: threading.Lock = field(default_factory=threading.Lock)  # one publish at a time
    # discovery (lock)
    inventory: Inventory | None = None
    host: Host | None = None
    offered: list[Offer] = field(default_factory=list)  # every offer discovered last
    found: list[FoundDevice] = field(default_factory=list)  # the PCI devices discovered last, of the served kinds
    known: dict[tuple[str, str], Offer] = field(default_factory=dict)  # since start: one gone while out stays tainted
    # the publishing round (publishing)
    since: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (pool, device, taint key) -> timeAdded
    published: list[dict[str, Any]] | None = None
    offered_now: list[Offer] = field(default_factory=list)  # the offers (tainted or not) of the slices adopted last
    held: dict[tuple[str, str], PluginHolding] = field(default_factory=dict)  # what the device plugin held then
    contested_shown: dict[tuple[str, str], str] = field(default_factory=dict)  # held devices kept for a claim, logged
    ledger_seen: str | None = None  # the ledger's identity at the last look
    # health.json
    health_read: NodeHealth = field(default_factory=lambda: NodeHealth())  # as last read whole (a broken one: kept)
    health_problem: str | None = None  # why health.json could not be read at the last look
    health_seen: str | None = None  # health.json as last looked at, when another agent's loop writes it
    # the threads' signals
    wake: threading.Event = field(default_factory=threading.Event)  # publish the slices now
    rediscover: threading.Event = field(default_factory=threading.Event)  # discover again before publishing
    round: float = field(default_factory=time.monotonic)  # when the loop last turned (/healthz)
    # the health loop, when this process runs it
    loop: Watcher | None = None
    loop_thread: threading.Thread | None = None
    loop_stop: threading.Event | None = None  # set to stop it (the driver's stop, or the loop handed over)


@dataclass(frozen=True, slots=True)
class SliceView:
    """The slices as they should be now and what was learned on the way to them (DraDriver.desired: nothing
    changed; DraDriver.adopt takes it in)."""

    slices: list[dict[str, Any]]
    offered: list[Offer]  # the offers (tainted or not) in them
    verdicts: dict[tuple[str, str], tuple[bool, str]]  # the health stream's: (pool, device) -> (healthy, why)
    held: dict[tuple[str, str], PluginHolding]  # what the device plugin holds
    contested: dict[tuple[str, str], str]  # held devices kept, tainted, for a claim allocated on them
    since: dict[tuple[str, str, str], str]  # the live taints' timeAdded
    forget: frozenset[tuple[str, str]]  # offers gone whose device is there with other offers
    health: NodeHealth
    health_problem: str | None


def _stamps(since: dict[tuple[str, str, str], str]) -> Callable[[Offer], Callable[[str], str]]:
    """A taint's timeAdded by its offer and key: the one in `since`, or now (put in `since`)."""
    def of(offer: Offer) -> Callable[[str], str]:
        def stamp(key: str) -> str:
            return since.setdefault((offer.pool, offer.name, key), _now_rfc3339())
        return stamp
    return of


class DraDriver:
    def __init__(self, opts: DraOptions, publisher: SliceApi,
                 get_claim: Callable[[str, str], dict[str, Any]] | None = None, node: Node | None = None) -> None:
        if opts.health not in HEALTH_MODES:
            raise DevinjectError(f"health {opts.health!r}: expected one of {', '.join(HEALTH_MODES)}")
        if opts.fatal_effect not in (NO_SCHEDULE, NO_EXECUTE):
            raise DevinjectError(f"fatal taint effect {opts.fatal_effect!r}: expected {NO_SCHEDULE} or {NO_EXECUTE}")
        self.opts = opts
        self.publisher = publisher
        self.state = DriverState(node or watched_node(opts.watch_options()))
        self.state.node.profiles  # noqa: B018 (loaded now: each rescan and the health loop take these)
        self.health = HealthBroadcast()
        from devinject.nodestate.pluginrelease import GonePodReleaser

        # the device plugin's bookings whose pods are gone, released with the device plugin gone too
        self.releaser = GonePodReleaser(opts.state_dir, opts.pods_dir or os.path.join(
            os.path.dirname(opts.plugin_dir.rstrip("/")), "pods"))
        self.preparer = Preparer(opts.driver, opts.cdi_dir, opts.state_dir, self.inventory,
                                 get_claim or publisher.get_claim, opts.generate,
                                 group_pods=publisher.group_pods if isinstance(publisher, GroupReader) else None,
                                 metadata=MetadataFiles(os.path.join(opts.plugin_dir, opts.driver,
                                                                     "dra-device-metadata"), opts.driver)
                                 if opts.device_metadata else None)
        self.metrics = DraMetrics()
        self.metrics.watch_prepared(self.preparer.prepared)
        self.status = StatusWriter(opts.driver, lambda: self.inventory().node.host, publisher.apply_claim_status) \
            if isinstance(publisher, StatusApplier) else None  # status.devices, written after each call
        self.servers = PluginServers(opts.driver, self.preparer, opts.plugin_dir, opts.registry_dir, self.health,
                                     self.metrics, self._prepared if self.status else None,
                                     self.status.unprepared if self.status else None, pod_uid=opts.pod_uid)
        self.http: MetricsServer | WaitingMetricsServer | None = None
        self.metrics_bound: str | None = None  # host:port /metrics listens on

    # the state's parts tests and the command look at
    @property
    def loop(self) -> Watcher | None:
        return self.state.loop

    @property
    def wake(self) -> threading.Event:
        return self.state.wake

    @property
    def published(self) -> list[dict[str, Any]] | None:
        return self.state.published

    @published.setter
    def published(self, slices: list[dict[str, Any]] | None) -> None:
        self.state.published = slices

    def discover(self) -> Inventory:
        """The node as discovered now: every offer (prepare knows the devices the health loop took out too,
        so a claim allocated just before a fault is still prepared, and the ledger's check refuses it)."""
        gen, state = self.opts.generate, self.state
        with state.lock:
            node = state.node = state.node.rescanned()
        versions = {f.profile.kind: driver_version(node.host, f.profile, []) for f in node.devices()}
        offered = shareable([o for o in offers(node, self.opts.node_name, versions)
                             if not gen.kinds or o.kind in gen.kinds], self.opts.capacity)
        found = [f for f in node.devices() if not gen.kinds or f.profile.kind in gen.kinds]
        with state.lock:
            state.offered, state.found, state.host = offered, found, node.host
            state.known.update({(o.pool, o.name): o for o in offered})
            state.inventory = Inventory(node, {(o.pool, o.name): o for o in offered})
            return state.inventory

    def inventory(self) -> Inventory:
        with self.state.lock:
            inventory = self.state.inventory
        return inventory if inventory is not None else self.discover()

    def _read_health(self) -> tuple[NodeHealth, str | None]:
        """health.json as it reads now, and why not when it cannot be read: then what it said last stands (a
        broken one is never read as "all healthy", for the slices' taints and the labels alike)."""
        try:
            return read_health(self.opts.state_dir), None
        except StateFileError as err:
            return self.state.health_read, err.message

    def _take_health(self, health: NodeHealth, problem: str | None) -> NodeHealth:
        """health.json's read kept as the last; a problem logged once."""
        if problem is not None and problem != self.state.health_problem:
            log.warning("%s; the slices keep the taints read before", problem)
        self.state.health_read, self.state.health_problem = health, problem
        return health

    def desired(self) -> list[dict[str, Any]]:
        """The slices from the offers discovered last and health.json as it reads now: a query, nothing of the
        driver's changes (`adopt` takes in what it learned: _publish does both)."""
        return self.slice_view().slices

    def slice_view(self) -> SliceView:
        """The slices as they should be now. A device out of discovery stays, tainted, while the loop keeps it
        out (a channel: always, as `gone`); one the loop has not judged yet is left out until it does
        (discovery may see an unbound or removed function before the loop's next round)."""
        health, problem = self._read_health()
        state = self.state
        with state.lock:
            host, offered, since = state.host, list(state.offered), dict(state.since)
            present = {(o.pool, o.name) for o in offered}
            vanished = [o for key, o in state.known.items() if key not in present]
        stamps = _stamps(since)
        verdicts: dict[tuple[str, str], tuple[bool, str]] = {}
        published: list[Offer] = []
        for offer in offered:
            reasons = fault_reasons(host, offer, health)
            verdicts[(offer.pool, offer.name)] = (not reasons, "; ".join(reasons))
            published.append(self._tainted(offer, reasons, stamps))
        present_devices = {offer_key(o) for o in offered}
        forget = frozenset((o.pool, o.name) for o in vanished if offer_key(o) in present_devices)
        for offer in vanished:  # one whose device is there with other offers (a MIG layout changed) is forgotten
            reasons = () if (offer.pool, offer.name) in forget else self._gone_reasons(offer, health)
            if reasons:  # not discovered, and not (yet) out: unpublished, kept for when the loop says so
                verdicts[(offer.pool, offer.name)] = (False, "; ".join(reasons))
                published.append(self._tainted(offer, reasons, stamps))
        held = self._plugin_held(published)
        contested = {k: v for k, v in contested_devices(self.preparer.contested()).items() if k in held}
        offered_now = contested_offers(published, held, contested, self.opts.driver, stamps)
        live = {(o.pool, o.name, t.key) for o in (*published, *offered_now) for t in o.taints}
        return SliceView(resource_slices(self.opts.driver, self.opts.node_name, offered_now), offered_now, verdicts,
                         held, contested, {k: v for k, v in since.items() if k in live}, forget, health, problem)

    @staticmethod
    def _gone_reasons(offer: Offer, health: NodeHealth) -> tuple[str, ...]:
        """Why an offer no longer discovered is out: the loop's reasons; a channel whose node is gone always."""
        reasons = fault_reasons(None, offer, health)
        if offer.channel is not None and not reasons:
            reasons = (f"{offer.channel.node.path}: no such node",)
        return reasons

    def adopt(self, view: SliceView) -> None:
        """What a slice view learned, taken in (`publishing` held): health.json's read, the offers gone for
        good, the taints' times, the health stream's verdicts, the held and contested devices (logged as they
        change)."""
        state = self.state
        self._take_health(view.health, view.health_problem)
        with state.lock:
            for key in view.forget:
                state.known.pop(key, None)
        state.since = view.since
        self.health.update(view.verdicts)
        for key in sorted(set(view.held) - set(state.held)):
            log.info("%s/%s leaves the slice: held by %s", key[0], key[1], view.held[key].who)
        for key in sorted(set(state.held) - set(view.held)):
            log.info("%s/%s is back in the slice: the device plugin released it", key[0], key[1])
        for key in sorted(set(view.contested) - set(state.contested_shown)):
            log.info("%s/%s stays in the slice tainted %s/%s NoExecute: held by %s, and claim %s is allocated on "
                     "it (its pod is evicted)", key[0], key[1], self.opts.driver, HELD_CAUSE, view.held[key].who,
                     view.contested[key])
        for key in sorted(set(state.contested_shown) - set(view.contested)):
            if key in view.held:
                log.info("%s/%s leaves the slice: no claim allocated on it waits any more", key[0], key[1])
        state.contested_shown, state.offered_now = view.contested, view.offered

    def _plugin_held(self, offered: list[Offer]) -> dict[tuple[str, str], PluginHolding]:
        """The offers the device plugin holds now (ledger.json), left out of the slices so that the scheduler
        places claims elsewhere. A ledger missing or broken says nothing of what the plugin holds: what it
        held stays out until the ledger is rebuilt and the plugin's bookings are back in it (each agent books
        its own again)."""
        from devinject.nodestate.profilefacts import sharing_policy

        data = Ledger(self.opts.state_dir).read()
        present = {(o.pool, o.name) for o in offered}
        return plugin_held(data, offered, sharing_policy(self.opts.state_dir)) if data is not None else \
            {k: v for k, v in self.state.held.items() if k in present}

    def _tainted(self, offer: Offer, reasons: tuple[str, ...], stamps: Callable[[Offer], Callable[[str], str]]) \
            -> Offer:
        if not reasons:
            return offer
        return replace(offer, taints=taints_for(self.opts.driver, reasons, self.opts.fatal_effect, stamps(offer)))

    def refresh(self, rediscover: bool = True) -> bool:
        """Rediscover (unless told not to: a verdict to publish at once), book the prepared claims again (a
        ledger rebuilt meanwhile knows none), publish (the publisher writes what the API's slices lack); True
        when the slices changed."""
        if rediscover or self.state.inventory is None:
            self.discover()
            self.preparer.rebook()
        self.write_labels()
        with self.state.publishing:
            return self._publish()

    def write_labels(self) -> bool:
        """NFD's feature file (agent/nfd.py) from the devices discovered last, those health.json has taken
        out not counted, as `watch` and `device-plugin` write it: a DRA-only node is labelled too. Written
        when it changed (True); a failed write is logged, the slices are published all the same."""
        if not self.opts.nfd_features_dir:
            return False
        from devinject.agent.nfd import features, write_features

        out = frozenset(self._take_health(*self._read_health()).reasons)
        with self.state.lock:
            host, found, node = self.state.host, list(self.state.found), self.state.node
        if host is None:
            return False
        try:
            written = write_features(self.opts.nfd_features_dir,
                                     features(host, found, out=out, gpu_facts=node.gpu_facts))
        except OSError as err:
            log.warning("%s: cannot write NFD's feature file: %s", self.opts.nfd_features_dir, err.strerror)
            return False
        if written:
            log.info("wrote the node's labels for NFD in %s", self.opts.nfd_features_dir)
        return written

    def _publish(self) -> bool:
        """Publish the slices as they should be now (health.json's taints, less what the device plugin
        holds), when they changed (`publishing` held)."""
        state, view = self.state, self.slice_view()
        self.adopt(view)
        desired = view.slices
        changed = desired != state.published
        # compared with the API's slices (the publisher's watch keeps a copy; without one it lists), not with
        # what was published last: a slice someone else deleted or edited is restored within a rescan
        self.publisher.publish(copy.deepcopy(desired))  # it sets generations and keeps taint times: not ours
        state.published, state.held = desired, view.held
        if changed:
            self.metrics.published(Counter(o.kind for o in view.offered))
            self.metrics.record_taints(Counter(t.key.split("/", 1)[-1] for o in view.offered
                                               for t in o.taints))
        return changed

    def alive(self) -> bool:
        """/healthz: the loop turned within three rounds (and a minute for a slow API server)."""
        return time.monotonic() - self.state.round < 3 * self.opts.rescan + 60

    def ready(self) -> bool:
        """/readyz: the kubelet registered the driver and its DRA socket is there."""
        return self.servers.registration.registered.is_set() and os.path.exists(self.servers.endpoint)

    # --- the health loop -----------------------------------------------------------------------------
    def _told(self, loop: Round) -> None:
        """From the health loop, after each verdict it wrote: publish now; rediscover first when the devices
        it found are not the ones discovered here last (a function unbound, removed or back), so the slices
        follow them at once too."""
        found = frozenset(device_key(f.profile.kind, f.address) for f in loop.found) | {c.key for c in loop.channels}
        with self.state.lock:
            offered = frozenset(offer_key(o) for o in self.state.offered)
        if found != offered:  # compared with what this driver discovered, which may be from another moment
            self.state.rediscover.set()
        self.state.wake.set()

    def start_health_loop(self, stop: threading.Event) -> bool:
        """Run the node's health loop on a thread when this process may (the state dir's loop lock is free;
        `follow`: never); True when it runs. `check` with the lock held elsewhere is an error."""
        state = self.state
        if state.loop is not None or self.opts.health == "follow":
            return state.loop is not None
        if self.opts.health == "auto" and healthstate.loop_wanted(self.opts.state_dir):
            return False  # an agent that owns the loop (watch, device-plugin) is back and asks for it
        fd = healthstate.take_loop_lock(self.opts.state_dir)
        if fd is None:
            if self.opts.health == "check":
                raise DevinjectError(f"{self.opts.state_dir}: another agent's health loop runs on this state dir "
                                     "(--health follow reads its verdicts)")
            return False
        watch = self.opts.watch_options()
        try:
            loop = Watcher(watch, loop_lock=fd, node=state.node.apart())
        except BaseException:
            os.close(fd)
            raise
        loop.publishers.append(self._told)  # the slices
        state.loop = loop
        loop_stop = state.loop_stop = threading.Event()  # the driver's stop, or the loop handed over

        def run() -> None:
            try:
                loop.run(loop_stop)
            except Exception:  # the driver keeps serving what health.json said last
                log.exception("the health loop stopped")

        def stop_with_the_driver() -> None:
            stop.wait()
            loop_stop.set()

        self._spawn("health-stop", stop_with_the_driver)
        state.loop_thread = self._spawn("health", run)
        log.info("health loop: in this process (interval %gs, recheck %gs, threshold %d, kernel log %s, uevents "
                 "%s); fatal faults taint %s", watch.interval, watch.recheck, watch.threshold, watch.kernel_log,
                 "on" if watch.uevents else "off", self.opts.fatal_effect)
        return True

    def follow_ledger_once(self) -> bool:
        """Publish again when the ledger changed and with it what the device plugin holds: a device it gave a
        pod leaves the slices within `ledger_poll` seconds, and is back as soon as it is released. True when
        published."""
        seen = path_identity(os.path.join(self.opts.state_dir, LEDGER_FILE))
        if seen == self.state.ledger_seen or self.state.published is None:
            return False
        self.state.ledger_seen = seen
        with self.state.publishing:
            return self._publish()

    def follow_contests_once(self) -> bool:
        """Publish again when a claim was refused on a held device, or forgotten: the device is kept in (or
        leaves) the slices within `ledger_poll` seconds. True when published."""
        if not self.preparer.contests_changed.is_set() or self.state.published is None:
            return False
        self.preparer.contests_changed.clear()
        with self.state.publishing:
            return self._publish()

    def check_contests(self) -> list[str]:
        """Read each claim refused on a held device from the API server (no lock held) and forget those that
        no longer point at it (deleted: its pod evicted; allocated elsewhere): the device then leaves the
        slice as any the plugin holds. A claim that cannot be read is kept. Nothing is read while no claim
        is refused, so an idle node costs the API server nothing. The uids forgotten."""
        gone = []
        for uid, contest in self.preparer.contested().items():
            try:
                claim: Mapping[str, Any] | None = self.preparer.get_claim(contest.namespace, contest.name)
            except ClaimReadError as err:
                if err.status != 404:
                    continue
                claim = None
            except DevinjectError:
                continue
            if not contest_stands(claim, uid, self.opts.driver, contest):
                gone.append(uid)
        if gone:
            log.info("claim(s) %s no longer allocated on a device the device plugin holds", ", ".join(gone))
            self.preparer.drop_contests(gone)
        return gone

    def _check_contests(self, stop: threading.Event) -> None:
        while not stop.wait(self.opts.contest_check):
            try:
                self.check_contests()
            except Exception:  # the checker must outlive any one failure
                log.exception("reading the claims refused on a held device")

    def _followed_health_changed(self) -> bool:
        """health.json is another file than at the last look (the loop that writes it is another agent's)."""
        seen = path_identity(os.path.join(self.opts.state_dir, HEALTH_FILE))
        changed, self.state.health_seen = seen != self.state.health_seen, seen
        return changed

    def hand_over_health_loop(self) -> bool:
        """`--health auto` runs the loop only as a stand-in: when the agent that owns it (`watch`,
        `device-plugin`) is back and asks for it, the loop stops here, its lock goes to that agent, and the
        driver follows its verdicts (two loops on one state dir would both rewrite its health state and take
        each other's put-back requests). True when handed over."""
        state = self.state
        if state.loop is None or self.opts.health != "auto" or not healthstate.loop_wanted(self.opts.state_dir):
            return False
        if state.loop_stop is not None:
            state.loop_stop.set()
        if state.loop_thread is not None:
            state.loop_thread.join(10)  # its run() lets the lock go as it ends
        state.loop, state.loop_thread, state.loop_stop = None, None, None
        log.info("health loop: handed to the agent that asked for it; following %s",
                 os.path.join(self.opts.state_dir, HEALTH_FILE))
        return True

    def _follow_ledger(self, stop: threading.Event) -> None:
        while not stop.wait(self.opts.ledger_poll):
            try:
                self.hand_over_health_loop()
                if self.state.loop is None and self._followed_health_changed():
                    self.state.wake.set()  # another agent's verdict: published now, not at the next rescan
                self.releaser.release()  # a release changes the ledger: published just below
                self.follow_ledger_once()
                self.follow_contests_once()
            except DevinjectError as err:
                self.state.ledger_seen = None  # try again at the next look
                log.warning("publishing ResourceSlices after a ledger change: %s", err.message)
            except Exception:  # the follower must outlive any one failure
                self.state.ledger_seen = None
                log.exception("following the ledger")

    def _prepared(self, namespace: str, name: str, uid: str, devices: list[PreparedDevice]) -> None:
        """A claim prepared: its devices' status entries queued (their PCI functions, for a NIC's netdev)."""
        assert self.status is not None
        offers = self.inventory().offers
        self.status.prepared(namespace, name, uid, [
            StatusDevice(d.pool, d.device, d.share_id, offer.device.address
                         if (offer := offers.get((d.pool, d.device))) is not None and offer.found is not None
                         else None) for d in devices])

    def start(self) -> None:
        if not os.path.exists(self.preparer.checkpoint.path):
            # there from the start: the device plugin on this node sees a DRA driver beside it (docs/dra.md)
            self.preparer.checkpoint.save({})
        removed = self.preparer.clean_orphans()
        if removed:
            log.info("%d half-prepared claim(s) cleaned up", len(removed))
        self.releaser.release()  # before the first slice: bookings of pods gone while no agent ran
        if self.opts.metrics_address:  # first: a port in use fails the start before any socket is made
            # in a pod, the pod a rolling update replaces may hold the port a while yet (the node's network)
            self.http = (serve_or_wait if self.opts.pod_uid else serve)(self.opts.metrics_address, self.metrics,
                                                                        self.alive, self.ready)
            host, port = self.http.server_address[:2]
            self.metrics_bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.servers.start()
        except BaseException:
            if self.http is not None:
                self.http.shutdown()
            raise
        log.info("devinject %s dra-driver %s on node %s: registration %s, DRA service %s, CDI specs in %s, "
                 "metrics %s", __version__, self.opts.driver, self.opts.node_name, self.servers.registration_path,
                 self.servers.endpoint, self.opts.cdi_dir, f"on {self.metrics_bound}" if self.metrics_bound else "off")

    def _spawn(self, name: str, target: Callable[..., object], *args: object) -> threading.Thread:
        """Every thread of the driver's starts here: a daemon thread, named for the logs."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def _start_threads(self, stop: threading.Event) -> None:
        """The driver's own threads beside its round (the health loop's start in start_health_loop): a stop
        wakes the round, the ledger follower, the contested claims' checker."""
        def wake_on_stop() -> None:
            stop.wait()
            self.state.wake.set()

        self._spawn("stop", wake_on_stop)
        self._spawn("ledger", self._follow_ledger, stop)
        self._spawn("contests", self._check_contests, stop)

    def run(self, stop: threading.Event) -> None:
        self.start()
        if not self.start_health_loop(stop):
            log.info("health: following %s, as another agent's health loop writes it%s",
                     os.path.join(self.opts.state_dir, HEALTH_FILE),
                     "" if self.opts.health == "follow" else " (taken over when it stops)")
        self._start_threads(stop)
        state, next_scan = self.state, 0.0
        try:
            while not stop.is_set():
                due = time.monotonic() >= next_scan
                if state.rediscover.is_set():
                    state.rediscover.clear()
                    due = True
                try:
                    if due and state.loop is None:
                        self.start_health_loop(stop)
                    self.refresh(rediscover=due)
                except DevinjectError as err:
                    self.metrics.publish_failed(err)
                    log.warning("publishing ResourceSlices: %s (again in %gs)", err.message, self.opts.rescan)
                state.round = time.monotonic()
                if due:
                    next_scan = time.monotonic() + self.opts.rescan
                state.wake.wait(max(0.0, next_scan - time.monotonic()))
                state.wake.clear()
        finally:
            self.servers.stop()
            if self.preparer.metadata is not None:
                self.preparer.metadata.close()
            if self.status is not None:
                self.status.close()
            if self.http is not None:
                self.http.shutdown()
            self._stop_health_loop()
            log.info("dra-driver stopped at %s", time.strftime("%H:%M:%S"))

    def _stop_health_loop(self) -> None:
        """After `stop`: the loop's thread ends within its wake-up and lets its lock go (a driver made again in
        this process, or another agent, may take the state dir)."""
        if self.state.loop_thread is not None:
            self.state.loop_thread.join(10)  # its run() lets the lock go as it ends
