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
from collections.abc import Callable
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
from devinject.nodestate.healthverdicts import HEALTH_FILE
from devinject.nodestate.ledger import LEDGER_FILE, Ledger, clashes, describe, held_nodes, is_plugin
from devinject.nodestate.statefile import StateFileError
from devinject.specs.generate import GenerateOptions, driver_version

log = logging.getLogger(__name__)

HEALTH_MODES = ("auto", "check", "follow")
HELD_CAUSE = "held-by-device-plugin"  # the taint on a device the plugin holds that a claim was allocated on
TAKEN_OUT = "taken out by the node's health checks"  # a device health.json names by its nodes alone


class Publisher(Protocol):
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


def plugin_held(data: dict[str, Any], offered: list[Offer],
                policy: dict[str, str]) -> dict[tuple[str, str], PluginHolding]:
    """(pool, device) -> who holds it through the device plugin: the offers a claim could not be prepared on
    now, left out of the slices so that the scheduler places claims elsewhere."""
    held = held_nodes(data, is_plugin)
    if not held[0] and not held[1]:
        return {}
    plugin = {cid: e for cid, e in data.get("allocations", {}).items() if is_plugin(e)}
    out: dict[tuple[str, str], PluginHolding] = {}
    for offer in offered:
        exclusive, shared = offer_holding(offer, policy)
        if not clashes(exclusive, shared, held):
            continue
        for cid, entry in plugin.items():
            if clashes(exclusive, shared, (set(entry["exclusive"]), set(entry.get("shared", [])))):
                out[(offer.pool, offer.name)] = PluginHolding(str(entry["plugin"]), describe(cid, entry))
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


def contest_stands(claim: dict[str, Any] | None, uid: str, driver: str, contest: Contest) -> bool:
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


class DraDriver:
    def __init__(self, opts: DraOptions, publisher: Publisher,
                 get_claim: Callable[[str, str], dict[str, Any]] | None = None, node: Node | None = None) -> None:
        if opts.health not in HEALTH_MODES:
            raise DevinjectError(f"health {opts.health!r}: expected one of {', '.join(HEALTH_MODES)}")
        if opts.fatal_effect not in (NO_SCHEDULE, NO_EXECUTE):
            raise DevinjectError(f"fatal taint effect {opts.fatal_effect!r}: expected {NO_SCHEDULE} or {NO_EXECUTE}")
        self.opts = opts
        self.publisher = publisher
        self.lock = threading.Lock()
        # the node as the last rescan read it; its profiles are loaded here, once, and kept by every rescan
        self.node = node or watched_node(opts.watch_options())
        self.node.profiles  # noqa: B018 (loaded now: each rescan and the health loop take these)
        self._inventory: Inventory | None = None
        self._host: Host | None = None
        self._all: list[Offer] = []
        self._found: list[FoundDevice] = []  # the PCI devices discovered last, of the served kinds (labels)
        self._known: dict[tuple[str, str], Offer] = {}  # every offer since start: one gone while out stays tainted
        self._since: dict[tuple[str, str, str], str] = {}  # (pool, device, taint key) -> its timeAdded
        self.health = HealthBroadcast()
        self.published: list[dict[str, Any]] | None = None
        self._offered_now: list[Offer] = []  # the offers (tainted or not) of the slices desired last
        self.loop: Watcher | None = None  # the health loop, when this process runs it
        self.wake = threading.Event()  # the loop published a verdict: publish the slices now
        self._health_thread: threading.Thread | None = None
        self._loop_stop: threading.Event | None = None  # set to stop the loop this process runs
        self._health_read = NodeHealth()  # health.json as last read whole: what a broken one leaves in place
        self._health_problem: str | None = None  # why health.json could not be read at the last look
        self._health_seen: str | None = None  # health.json as last looked at, when another agent's loop writes it
        self.rediscover = threading.Event()  # the loop found other devices: discover again before publishing
        self.publishing = threading.Lock()  # one publish at a time: the rescan's and the ledger follower's
        self._held: dict[tuple[str, str], PluginHolding] = {}  # offers the device plugin holds now
        self._ledger_seen: str | None = None
        self._held_desired: dict[tuple[str, str], PluginHolding] = {}  # what desired() last found held
        self._contested_shown: dict[tuple[str, str], str] = {}  # held devices kept tainted for a claim, logged
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
        self._round = time.monotonic()  # when the loop last turned (/healthz)

    def discover(self) -> Inventory:
        """The node as discovered now: every offer (prepare knows the devices the health loop took out too,
        so a claim allocated just before a fault is still prepared, and the ledger's check refuses it)."""
        gen = self.opts.generate
        with self.lock:
            node = self.node = self.node.rescanned()
        versions = {f.profile.kind: driver_version(node.host, f.profile, []) for f in node.devices()}
        offered = shareable([o for o in offers(node, self.opts.node_name, versions)
                             if not gen.kinds or o.kind in gen.kinds], self.opts.capacity)
        found = [f for f in node.devices() if not gen.kinds or f.profile.kind in gen.kinds]
        with self.lock:
            self._all = offered
            self._found = found
            self._host = node.host
            self._known.update({(o.pool, o.name): o for o in offered})
            self._inventory = Inventory(node, {(o.pool, o.name): o for o in offered})
            return self._inventory

    def inventory(self) -> Inventory:
        with self.lock:
            inventory = self._inventory
        return inventory if inventory is not None else self.discover()

    def _since_of(self, offer: Offer) -> Callable[[str], str]:
        def since(key: str) -> str:
            return self._since.setdefault((offer.pool, offer.name, key), _now_rfc3339())
        return since

    def _health_now(self) -> NodeHealth:
        """health.json as it reads now; a broken one is never read as "all healthy": what it said last stands
        (for the slices' taints and the labels alike), and the problem is logged once."""
        try:
            self._health_read = read_health(self.opts.state_dir)
            self._health_problem = None
        except StateFileError as err:
            if err.message != self._health_problem:
                log.warning("%s; the slices keep the taints read before", err.message)
            self._health_problem = err.message
        return self._health_read

    def desired(self) -> list[dict[str, Any]]:
        """The slices from the offers discovered last and health.json as it reads now; the health stream is
        updated on the way. A device out of discovery stays, tainted, while the loop keeps it out (a channel:
        always, as `gone`); one the loop has not judged yet is left out until it does (discovery may see an
        unbound or removed function before the loop's next round)."""
        health = self._health_now()
        with self.lock:
            host, offered = self._host, list(self._all)
            present = {(o.pool, o.name) for o in offered}
            vanished = [o for key, o in self._known.items() if key not in present]
        verdicts: dict[tuple[str, str], tuple[bool, str]] = {}
        published: list[Offer] = []
        for offer in offered:
            reasons = fault_reasons(host, offer, health)
            verdicts[(offer.pool, offer.name)] = (not reasons, "; ".join(reasons))
            published.append(self._tainted(offer, reasons))
        present_devices = {offer_key(o) for o in offered}
        for offer in vanished:
            if offer_key(offer) in present_devices:  # its device is there with other offers (a MIG layout changed)
                with self.lock:
                    self._known.pop((offer.pool, offer.name), None)
                continue
            reasons = fault_reasons(None, offer, health)
            if offer.channel is not None and not reasons:
                reasons = (f"{offer.channel.node.path}: no such node",)
            if not reasons:  # not discovered, and not (yet) out: unpublished, kept for when the loop says so
                continue
            verdicts[(offer.pool, offer.name)] = (False, "; ".join(reasons))
            published.append(self._tainted(offer, reasons))
        self.health.update(verdicts)
        held = self._plugin_held(published)
        contested = {k: v for k, v in contested_devices(self.preparer.contested()).items() if k in held}
        for key in sorted(set(contested) - set(self._contested_shown)):
            log.info("%s/%s stays in the slice tainted %s/%s NoExecute: held by %s, and claim %s is allocated on "
                     "it (its pod is evicted)", key[0], key[1], self.opts.driver, HELD_CAUSE, held[key].who,
                     contested[key])
        for key in sorted(set(self._contested_shown) - set(contested)):
            if key in held:
                log.info("%s/%s leaves the slice: no claim allocated on it waits any more", key[0], key[1])
        self._contested_shown = contested
        self._offered_now = contested_offers(published, held, contested, self.opts.driver, self._since_of)
        live = {(o.pool, o.name, t.key) for o in (*published, *self._offered_now) for t in o.taints}
        self._since = {k: v for k, v in self._since.items() if k in live}
        self._held_desired = held
        return resource_slices(self.opts.driver, self.opts.node_name, self._offered_now)

    def _plugin_held(self, offered: list[Offer]) -> dict[tuple[str, str], PluginHolding]:
        """The offers the device plugin holds now (ledger.json), left out of the slices so that the scheduler
        places claims elsewhere. A ledger missing or broken says nothing of what the plugin holds: what it
        held stays out until the ledger is rebuilt and the plugin's bookings are back in it (each agent books
        its own again)."""
        from devinject.nodestate.profilefacts import sharing_policy

        data = Ledger(self.opts.state_dir).read()
        present = {(o.pool, o.name) for o in offered}
        held = plugin_held(data, offered, sharing_policy(self.opts.state_dir)) if data is not None else \
            {k: v for k, v in self._held.items() if k in present}
        for key in sorted(set(held) - set(self._held)):
            log.info("%s/%s leaves the slice: held by %s", key[0], key[1], held[key].who)
        for key in sorted(set(self._held) - set(held)):
            log.info("%s/%s is back in the slice: the device plugin released it", key[0], key[1])
        return held

    def _tainted(self, offer: Offer, reasons: tuple[str, ...]) -> Offer:
        if not reasons:
            return offer
        return replace(offer, taints=taints_for(self.opts.driver, reasons, self.opts.fatal_effect,
                                                self._since_of(offer)))

    def refresh(self, rediscover: bool = True) -> bool:
        """Rediscover (unless told not to: a verdict to publish at once), book the prepared claims again (a
        ledger rebuilt meanwhile knows none), publish (the publisher writes what the API's slices lack); True
        when the slices changed."""
        if rediscover or self._inventory is None:
            self.discover()
            self.preparer.rebook()
        self.write_labels()
        with self.publishing:
            return self._publish()

    def write_labels(self) -> bool:
        """NFD's feature file (agent/nfd.py) from the devices discovered last, those health.json has taken
        out not counted, as `watch` and `device-plugin` write it: a DRA-only node is labelled too. Written
        when it changed (True); a failed write is logged, the slices are published all the same."""
        if not self.opts.nfd_features_dir:
            return False
        from devinject.agent.nfd import features, write_features

        out = frozenset(self._health_now().reasons)
        with self.lock:
            host, found = self._host, list(self._found)
        if host is None:
            return False
        try:
            written = write_features(self.opts.nfd_features_dir, features(host, found, out=out))
        except OSError as err:
            log.warning("%s: cannot write NFD's feature file: %s", self.opts.nfd_features_dir, err.strerror)
            return False
        if written:
            log.info("wrote the node's labels for NFD in %s", self.opts.nfd_features_dir)
        return written

    def _publish(self) -> bool:
        """Publish the slices as they should be now (health.json's taints, less what the device plugin
        holds), when they changed (`publishing` held)."""
        desired = self.desired()
        held = self._held_desired
        changed = desired != self.published
        # compared with the API's slices (the publisher's watch keeps a copy; without one it lists), not with
        # what was published last: a slice someone else deleted or edited is restored within a rescan
        self.publisher.publish(copy.deepcopy(desired))  # it sets generations and keeps taint times: not ours
        self.published, self._held = desired, held
        if changed:
            self.metrics.published(Counter(o.kind for o in self._offered_now))
            self.metrics.record_taints(Counter(t.key.split("/", 1)[-1] for o in self._offered_now
                                               for t in o.taints))
        return changed

    def alive(self) -> bool:
        """/healthz: the loop turned within three rounds (and a minute for a slow API server)."""
        return time.monotonic() - self._round < 3 * self.opts.rescan + 60

    def ready(self) -> bool:
        """/readyz: the kubelet registered the driver and its DRA socket is there."""
        return self.servers.registration.registered.is_set() and os.path.exists(self.servers.endpoint)

    # --- the health loop -----------------------------------------------------------------------------
    def _told(self, loop: Round) -> None:
        """From the health loop, after each verdict it wrote: publish now; rediscover first when the devices
        it found are not the ones discovered here last (a function unbound, removed or back), so the slices
        follow them at once too."""
        found = frozenset(device_key(f.profile.kind, f.address) for f in loop.found) | {c.key for c in loop.channels}
        with self.lock:
            offered = frozenset(offer_key(o) for o in self._all)
        if found != offered:  # compared with what this driver discovered, which may be from another moment
            self.rediscover.set()
        self.wake.set()

    def start_health_loop(self, stop: threading.Event) -> bool:
        """Run the node's health loop on a thread when this process may (the state dir's loop lock is free;
        `follow`: never); True when it runs. `check` with the lock held elsewhere is an error."""
        if self.loop is not None or self.opts.health == "follow":
            return self.loop is not None
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
            loop = Watcher(watch, loop_lock=fd, node=self.node.apart())
        except BaseException:
            os.close(fd)
            raise
        loop.publishers.append(self._told)  # the slices
        self.loop = loop
        loop_stop = self._loop_stop = threading.Event()  # the driver's stop, or the loop handed over

        def run() -> None:
            try:
                loop.run(loop_stop)
            except Exception:  # the driver keeps serving what health.json said last
                log.exception("the health loop stopped")

        def stop_with_the_driver() -> None:
            stop.wait()
            loop_stop.set()

        threading.Thread(target=stop_with_the_driver, name="health-stop", daemon=True).start()

        self._health_thread = threading.Thread(target=run, name="health", daemon=True)
        self._health_thread.start()
        log.info("health loop: in this process (interval %gs, recheck %gs, threshold %d, kernel log %s, uevents "
                 "%s); fatal faults taint %s", watch.interval, watch.recheck, watch.threshold, watch.kernel_log,
                 "on" if watch.uevents else "off", self.opts.fatal_effect)
        return True

    def follow_ledger_once(self) -> bool:
        """Publish again when the ledger changed and with it what the device plugin holds: a device it gave a
        pod leaves the slices within `ledger_poll` seconds, and is back as soon as it is released. True when
        published."""
        seen = path_identity(os.path.join(self.opts.state_dir, LEDGER_FILE))
        if seen == self._ledger_seen or self.published is None:
            return False
        self._ledger_seen = seen
        with self.publishing:
            return self._publish()

    def follow_contests_once(self) -> bool:
        """Publish again when a claim was refused on a held device, or forgotten: the device is kept in (or
        leaves) the slices within `ledger_poll` seconds. True when published."""
        if not self.preparer.contests_changed.is_set() or self.published is None:
            return False
        self.preparer.contests_changed.clear()
        with self.publishing:
            return self._publish()

    def check_contests(self) -> list[str]:
        """Read each claim refused on a held device from the API server (no lock held) and forget those that
        no longer point at it (deleted: its pod evicted; allocated elsewhere): the device then leaves the
        slice as any the plugin holds. A claim that cannot be read is kept. Nothing is read while no claim
        is refused, so an idle node costs the API server nothing. The uids forgotten."""
        gone = []
        for uid, contest in self.preparer.contested().items():
            try:
                claim: dict[str, Any] | None = self.preparer.get_claim(contest.namespace, contest.name)
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
        changed, self._health_seen = seen != self._health_seen, seen
        return changed

    def hand_over_health_loop(self) -> bool:
        """`--health auto` runs the loop only as a stand-in: when the agent that owns it (`watch`,
        `device-plugin`) is back and asks for it, the loop stops here, its lock goes to that agent, and the
        driver follows its verdicts (two loops on one state dir would both rewrite its health state and take
        each other's put-back requests). True when handed over."""
        if self.loop is None or self.opts.health != "auto" or not healthstate.loop_wanted(self.opts.state_dir):
            return False
        if self._loop_stop is not None:
            self._loop_stop.set()
        if self._health_thread is not None:
            self._health_thread.join(10)  # its run() lets the lock go as it ends
        self.loop, self._health_thread, self._loop_stop = None, None, None
        log.info("health loop: handed to the agent that asked for it; following %s",
                 os.path.join(self.opts.state_dir, HEALTH_FILE))
        return True

    def _follow_ledger(self, stop: threading.Event) -> None:
        while not stop.wait(self.opts.ledger_poll):
            try:
                self.hand_over_health_loop()
                if self.loop is None and self._followed_health_changed():
                    self.wake.set()  # another agent's verdict: published now, not at the next rescan
                self.releaser.release()  # a release changes the ledger: published just below
                self.follow_ledger_once()
                self.follow_contests_once()
            except DevinjectError as err:
                self._ledger_seen = None  # try again at the next look
                log.warning("publishing ResourceSlices after a ledger change: %s", err.message)
            except Exception:  # the follower must outlive any one failure
                self._ledger_seen = None
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

    def run(self, stop: threading.Event) -> None:
        self.start()
        if not self.start_health_loop(stop):
            log.info("health: following %s, as another agent's health loop writes it%s",
                     os.path.join(self.opts.state_dir, HEALTH_FILE),
                     "" if self.opts.health == "follow" else " (taken over when it stops)")

        def wake_on_stop() -> None:
            stop.wait()
            self.wake.set()

        threading.Thread(target=wake_on_stop, name="stop", daemon=True).start()
        next_scan = 0.0
        follower = threading.Thread(target=self._follow_ledger, args=(stop,), name="ledger", daemon=True)
        follower.start()
        threading.Thread(target=self._check_contests, args=(stop,), name="contests", daemon=True).start()
        try:
            while not stop.is_set():
                due = time.monotonic() >= next_scan
                if self.rediscover.is_set():
                    self.rediscover.clear()
                    due = True
                try:
                    if due and self.loop is None:
                        self.start_health_loop(stop)
                    self.refresh(rediscover=due)
                except DevinjectError as err:
                    self.metrics.publish_failed(err)
                    log.warning("publishing ResourceSlices: %s (again in %gs)", err.message, self.opts.rescan)
                self._round = time.monotonic()
                if due:
                    next_scan = time.monotonic() + self.opts.rescan
                self.wake.wait(max(0.0, next_scan - time.monotonic()))
                self.wake.clear()
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
        if self._health_thread is not None:
            self._health_thread.join(10)  # its run() lets the lock go as it ends
