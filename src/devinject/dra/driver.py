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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from devinject import __version__
from devinject.agent.metricsserver import MetricsServer, serve
from devinject.core import jsonlite
from devinject.core.errors import DevinjectError
from devinject.core.identity import node_id_of
from devinject.core.paths import DEFAULT_STATE_DIR, DYNAMIC_SPEC_DIR
from devinject.discovery.channels import channel_fault
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.dra.claims import Inventory, Preparer
from devinject.dra.metrics import DraMetrics
from devinject.dra.server import HealthState, PluginServers
from devinject.dra.slices import DRIVER, Offer, offers, resource_slices
from devinject.nodestate.ledger import HEALTH_FILE
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
    metrics_address: str | None = None  # host:port of /metrics, /healthz, /readyz (dra/metrics.py)


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
        self.preparer = Preparer(opts.driver, opts.cdi_dir, opts.state_dir, self.inventory,
                                 get_claim or publisher.get_claim, opts.generate)
        self.metrics = DraMetrics()
        self.metrics.watch_prepared(self.preparer.prepared)
        self.servers = PluginServers(opts.driver, self.preparer, opts.plugin_dir, opts.registry_dir, self.health,
                                     self.metrics)
        self.http: MetricsServer | None = None
        self.metrics_bound: str | None = None  # host:port /metrics listens on
        self._round = time.monotonic()  # when the loop last turned (/healthz)

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
        served = [o for o in offered if verdicts[(o.pool, o.name)][0]]
        desired = resource_slices(self.opts.driver, self.opts.node_name, served)
        if desired == self.published:
            return False
        self.publisher.publish([dict(s) for s in desired])
        self.published = desired
        self.metrics.published(Counter(o.kind for o in served))
        return True

    def alive(self) -> bool:
        """/healthz: the loop turned within three rounds (and a minute for a slow API server)."""
        return time.monotonic() - self._round < 3 * self.opts.rescan + 60

    def ready(self) -> bool:
        """/readyz: the kubelet registered the driver and its DRA socket is there."""
        return self.servers.registration.registered.is_set() and os.path.exists(self.servers.endpoint)

    def start(self) -> None:
        removed = self.preparer.clean_orphans()
        if removed:
            log.info("%d half-prepared claim(s) cleaned up", len(removed))
        self.servers.start()
        if self.opts.metrics_address:
            self.http = serve(self.opts.metrics_address, self.metrics, self.alive, self.ready)
            host, port = self.http.server_address[:2]
            self.metrics_bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("devinject %s dra-driver %s on node %s: registration %s, DRA service %s, CDI specs in %s, "
                 "metrics %s", __version__, self.opts.driver, self.opts.node_name, self.servers.registration_path,
                 self.servers.endpoint, self.opts.cdi_dir, f"on {self.metrics_bound}" if self.metrics_bound else "off")

    def run(self, stop: threading.Event) -> None:
        self.start()
        try:
            while not stop.is_set():
                try:
                    self.refresh()
                except DevinjectError as err:
                    self.metrics.publish_failed(err)
                    log.warning("publishing ResourceSlices: %s (again in %gs)", err.message, self.opts.rescan)
                self._round = time.monotonic()
                stop.wait(self.opts.rescan)
        finally:
            self.servers.stop()
            if self.http is not None:
                self.http.shutdown()
            log.info("dra-driver stopped at %s", time.strftime("%H:%M:%S"))
