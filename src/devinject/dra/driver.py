"""`devinject dra-driver`: the DRA kubelet plugin and ResourceSlice publisher for one node (docs/dra.md).

Every `rescan` seconds the node is discovered again (discovery/node.py, as every command sees it); its
offers (dra/slices.py) minus the devices `watch` took out (their nodes in the state dir's health.json, the
file the hook and the ledger read) are published when they changed, and the health stream the kubelet
watches says which devices are unhealthy. An IMEX channel (a char node, no PCI function) is judged by its
node as `health` judges it (discovery/channels.py channel_fault): one whose node is gone, or has other
numbers, leaves the slice and is unhealthy, as a device `watch` took out. Claims are prepared by
dra/claims.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from devinject import __version__
from devinject.core import jsonlite
from devinject.core.errors import DevinjectError
from devinject.core.identity import node_id_of
from devinject.core.paths import DEFAULT_STATE_DIR, DYNAMIC_SPEC_DIR
from devinject.discovery.channels import channel_fault
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.dra.claims import Inventory, Preparer
from devinject.dra.server import HealthState, PluginServers
from devinject.dra.slices import DRIVER, Offer, offers, resource_slices
from devinject.nodestate.ledger import HEALTH_FILE, LEDGER_FILE, Ledger, clashes, describe, held_nodes, is_plugin
from devinject.specs.generate import GenerateOptions, driver_version

log = logging.getLogger(__name__)


class Publisher(Protocol):
    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]: ...
    def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


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
    ledger_poll: float = 0.5  # seconds between looks at the ledger (the device plugin's bookings)


def unhealthy_nodes(state_dir: str) -> set[str]:
    """The device nodes `watch` took out (health.json); none when no agent writes it or it cannot be read
    (the ledger refuses those bookings itself)."""
    try:
        with open(os.path.join(state_dir, HEALTH_FILE), encoding="utf-8") as handle:
            nodes = jsonlite.loads(handle.read()).get("unhealthy_nodes", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {n for n in nodes if isinstance(n, str)} if isinstance(nodes, list) else set()


def _verdict(host: Host, offer: Offer, unhealthy: set[str]) -> tuple[bool, str]:
    """(healthy, why not): a channel whose node is gone or not its own; nodes `watch` took out."""
    fault = channel_fault(host, offer.channel) if offer.channel is not None else None
    if fault is not None:
        return False, fault
    if any(node_id_of(n) in unhealthy for n in offer.nodes):
        return False, "taken out by the node's health checks"
    return True, ""


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


def plugin_held(data: dict[str, Any], offered: list[Offer], policy: dict[str, str]) -> dict[tuple[str, str], str]:
    """(pool, device) -> who holds it through the device plugin: the offers a claim could not be prepared on
    now, left out of the slices so that the scheduler places claims elsewhere."""
    held = held_nodes(data, is_plugin)
    if not held[0] and not held[1]:
        return {}
    plugin = {cid: e for cid, e in data.get("allocations", {}).items() if is_plugin(e)}
    out: dict[tuple[str, str], str] = {}
    for offer in offered:
        exclusive, shared = offer_holding(offer, policy)
        if not clashes(exclusive, shared, held):
            continue
        for cid, entry in plugin.items():
            if clashes(exclusive, shared, (set(entry["exclusive"]), set(entry.get("shared", [])))):
                out[(offer.pool, offer.name)] = describe(cid, entry)
                break
    return out


class DraDriver:
    def __init__(self, opts: DraOptions, publisher: Publisher,
                 get_claim: Callable[[str, str], dict[str, Any]] | None = None) -> None:
        self.opts = opts
        self.publisher = publisher
        self.lock = threading.Lock()
        self._inventory: Inventory | None = None
        self._all: list[Offer] = []
        self._channels: dict[tuple[str, str], Offer] = {}  # every channel offered since start: one gone is unhealthy
        self.health = HealthState()
        self.published: list[dict[str, Any]] | None = None
        self.publishing = threading.Lock()  # one publish at a time: the rescan's and the ledger follower's
        self._ready: list[Offer] = []  # the healthy offers of the last rescan
        self._held: dict[tuple[str, str], str] = {}  # offers the device plugin holds now: not in the slices
        self._ledger_seen: object = None
        self.preparer = Preparer(opts.driver, opts.cdi_dir, opts.state_dir, self.inventory,
                                 get_claim or publisher.get_claim, opts.generate)
        self.servers = PluginServers(opts.driver, self.preparer, opts.plugin_dir, opts.registry_dir, self.health)

    def discover(self) -> Inventory:
        """The node as discovered now: every offer (prepare knows the devices the health loop took out too,
        so a claim allocated just before a fault is still prepared, and the ledger's check refuses it)."""
        gen = self.opts.generate
        node = Node(gen.root, target_root=gen.target_root, profile_dirs=gen.profile_dirs, check=False)
        versions = {f.profile.kind: driver_version(node.host, f.profile, []) for f in node.devices()}
        offered = [o for o in offers(node, self.opts.node_name, versions)
                   if not gen.kinds or o.kind in gen.kinds]
        with self.lock:
            self._all = offered
            self._channels.update({(o.pool, o.name): o for o in offered if o.channel is not None})
            self._inventory = Inventory(node, {(o.pool, o.name): o for o in offered})
            return self._inventory

    def inventory(self) -> Inventory:
        with self.lock:
            inventory = self._inventory
        return inventory if inventory is not None else self.discover()

    def refresh(self) -> bool:
        """Rediscover, book the prepared claims again (a ledger rebuilt meanwhile knows none), publish when the
        slices changed; True when published."""
        host = self.discover().node.host
        self.preparer.rebook()
        unhealthy = unhealthy_nodes(self.opts.state_dir)
        with self.lock:
            offered = list(self._all)
            present = {(o.pool, o.name) for o in offered}
            gone = [o for key, o in self._channels.items() if key not in present]
        verdicts = {(o.pool, o.name): _verdict(host, o, unhealthy) for o in [*offered, *gone]}
        self.health.update(verdicts)
        with self.publishing:
            self._ready = [o for o in offered if verdicts[(o.pool, o.name)][0]]
            return self._publish()

    def _publish(self) -> bool:
        """Publish the healthy offers but those the device plugin holds, when that changed (`publishing`
        held)."""
        from devinject.nodestate.profilefacts import sharing_policy

        data = Ledger(self.opts.state_dir).read()
        # a ledger missing or broken says nothing of what the plugin holds: what it held stays out until the
        # ledger is rebuilt and the plugin's bookings are back in it (each agent books its own again)
        held = plugin_held(data, self._ready, sharing_policy(self.opts.state_dir)) if data is not None else \
            {k: v for k, v in self._held.items() if k in {(o.pool, o.name) for o in self._ready}}
        for key in sorted(set(held) - set(self._held)):
            log.info("%s/%s leaves the slice: held by %s", key[0], key[1], held[key])
        for key in sorted(set(self._held) - set(held)):
            log.info("%s/%s is back in the slice: the device plugin released it", key[0], key[1])
        desired = resource_slices(self.opts.driver, self.opts.node_name,
                                  [o for o in self._ready if (o.pool, o.name) not in held])
        if desired == self.published:
            self._held = held
            return False
        self.publisher.publish([dict(s) for s in desired])
        self.published, self._held = desired, held
        return True

    def follow_ledger_once(self) -> bool:
        """Publish again when the ledger changed and with it what the device plugin holds: a device it gave a
        pod leaves the slices within `ledger_poll` seconds, and is back as soon as it is released. True when
        published."""
        try:
            st = os.stat(os.path.join(self.opts.state_dir, LEDGER_FILE))
            seen: object = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            seen = None
        if seen == self._ledger_seen or self.published is None:
            return False
        self._ledger_seen = seen
        with self.publishing:
            return self._publish()

    def _follow_ledger(self, stop: threading.Event) -> None:
        while not stop.wait(self.opts.ledger_poll):
            try:
                self.follow_ledger_once()
            except DevinjectError as err:
                self._ledger_seen = None  # try again at the next look
                log.warning("publishing ResourceSlices after a ledger change: %s", err.message)
            except Exception:  # the follower must outlive any one failure
                self._ledger_seen = None
                log.exception("following the ledger")

    def start(self) -> None:
        if not os.path.exists(self.preparer.checkpoint.path):
            # there from the start: the device plugin on this node sees a DRA driver beside it (docs/dra.md)
            self.preparer.checkpoint.save({})
        removed = self.preparer.clean_orphans()
        if removed:
            log.info("%d half-prepared claim(s) cleaned up", len(removed))
        self.servers.start()
        log.info("devinject %s dra-driver %s on node %s: registration %s, DRA service %s, CDI specs in %s",
                 __version__, self.opts.driver, self.opts.node_name, self.servers.registration_path,
                 self.servers.endpoint, self.opts.cdi_dir)

    def run(self, stop: threading.Event) -> None:
        self.start()
        follower = threading.Thread(target=self._follow_ledger, args=(stop,), name="ledger", daemon=True)
        follower.start()
        try:
            while not stop.is_set():
                try:
                    self.refresh()
                except DevinjectError as err:
                    log.warning("publishing ResourceSlices: %s (again in %gs)", err.message, self.opts.rescan)
                stop.wait(self.opts.rescan)
        finally:
            self.servers.stop()
            log.info("dra-driver stopped at %s", time.strftime("%H:%M:%S"))
