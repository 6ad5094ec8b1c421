"""`devinject watch`: keep the CDI specs true to the hardware.

Rescans on kernel uevents (netlink, via pyroute2) and periodically as a safety net; polls health every
`interval` seconds, re-checks a failing device every `recheck` seconds, and acts only after `threshold`
consecutive failures (or passes, to put a device back), so one glitch does not flap.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from devinject.agent.health import (
    DEFAULT_KERNEL_LOG,
    HEALTHY,
    UNHEALTHY,
    AerBaseline,
    HealthChecker,
    Verdict,
    unbound_functions,
    unbound_verdict,
)
from devinject.core import jsonlite
from devinject.core.errors import LedgerError
from devinject.core.identity import device_key
from devinject.core.model import Spec
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.nodestate import events
from devinject.nodestate.ledger import HEALTH_FILE, Ledger
from devinject.specs.generate import GenerateOptions, build_specs, discover_devices, select_profiles, write_specs

log = logging.getLogger(__name__)

RESCAN_DEBOUNCE = 0.2
BASE_UEVENTS = ("pci",)  # a function appearing or going: every family; the rest come from the profiles


def wants_rescan(message: Any, subsystems: tuple[str, ...] | frozenset[str] = BASE_UEVENTS) -> bool:
    """A kernel uevent about a subsystem whose devices we offer (add/remove/bind/unbind/change)."""
    try:
        return str(message.get("SUBSYSTEM", "")) in subsystems
    except AttributeError:
        return False


@dataclass(frozen=True)
class WatchOptions:
    generate: GenerateOptions
    output_dir: Path = Path("/var/run/cdi")
    state_dir: str = "/run/devinject"
    fmt: str = "yaml"
    interval: float = 10.0
    recheck: float = 1.5
    threshold: int = 3
    rescan: float = 60.0
    kernel_log: str = DEFAULT_KERNEL_LOG
    probe_timeout: float = 2.0
    uevents: bool = True


@dataclass
class DeviceTrack:
    published: str = HEALTHY  # what the specs reflect
    fails: int = 0
    passes: int = 0
    last: Verdict | None = None
    observed: str = HEALTHY  # the latest verdict's status, published or not


@dataclass
class Watcher:
    opts: WatchOptions
    tracks: dict[str, DeviceTrack] = field(default_factory=dict)
    found: list[FoundDevice] = field(default_factory=list)
    unbound: list[Verdict] = field(default_factory=list)
    generation: int | None = None
    specs: list[Spec] = field(default_factory=list)  # as last written
    listeners: list[Callable[[Watcher], None]] = field(default_factory=list)  # told after every write

    def __post_init__(self) -> None:
        self.host = Host(self.opts.generate.root)
        self.profiles = select_profiles(self.host, self.opts.generate)
        self.uevent_subsystems = frozenset(BASE_UEVENTS).union(*(p.uevents for p in self.profiles))
        self.checker = HealthChecker(self.host, kernel_log=self.opts.kernel_log, timeout=self.opts.probe_timeout,
                                     baseline=AerBaseline())
        self.written_kinds: set[str] = set()
        self.rescan_requested = threading.Event()

    # --- one round -----------------------------------------------------------------------------------
    def rescan(self) -> bool:
        """Rediscover; returns True when the set of devices changed."""
        self.host.refresh()
        found = discover_devices(self.host, self.profiles, self.opts.generate)
        before = {device_key(f.profile.kind, f.address) for f in self.found}
        after = {device_key(f.profile.kind, f.address): f for f in found}
        for key in sorted(set(after) - before):
            if self.tracks:
                events.record(self.opts.state_dir, "added", key)
            self.checker.clear_xids(after[key].address)  # a device that came back was reset: forget its past
            if self.checker.baseline is not None:
                self.checker.baseline.counts.pop(after[key].address, None)
        for key in sorted(before - set(after)):
            events.record(self.opts.state_dir, "removed", key)
        self.found = found
        self.unbound = [unbound_verdict(p, pci) for p, pci in unbound_functions(self.host, self.profiles)]
        return set(after) != before

    def check(self) -> bool:
        """Health round; returns True when the published state changed (specs must be rewritten)."""
        self.host.refresh()
        verdicts = self.checker.check(self.found) + self.unbound
        present = {v.key for v in verdicts}
        verdicts += [Verdict(key, t.last.kind, t.last.address, UNHEALTHY, (f"{t.last.address}: no longer present",),
                             t.last.nodes)
                     for key, t in self.tracks.items() if key not in present and t.last is not None]
        changed = False
        for verdict in verdicts:
            track = self.tracks.setdefault(verdict.key, DeviceTrack())
            if verdict.nodes or track.last is None:
                track.last = verdict
            else:  # keep the nodes we knew, so the ledger can still refuse them
                track.last = replace(verdict, nodes=track.last.nodes)
            if verdict.status != track.observed:  # every observed change is an event, debounced or not
                events.record(self.opts.state_dir, verdict.status, verdict.key, reasons=list(verdict.reasons),
                              previous=track.observed)
                track.observed = verdict.status
            failing = verdict.status == UNHEALTHY
            track.fails, track.passes = (track.fails + 1, 0) if failing else (0, track.passes + 1)
            if track.published != UNHEALTHY and track.fails >= self.opts.threshold:
                track.published = UNHEALTHY
                changed = True
                events.record(self.opts.state_dir, "taken-out", verdict.key, reasons=list(verdict.reasons))
            elif track.published == UNHEALTHY and track.passes >= self.opts.threshold:
                track.published = HEALTHY
                changed = True
                events.record(self.opts.state_dir, "put-back", verdict.key, status=verdict.status)
        return changed

    def unhealthy(self) -> frozenset[str]:
        return frozenset(k for k, t in self.tracks.items() if t.published == UNHEALTHY)

    def write(self) -> int | None:
        gen = replace(self.opts.generate, exclude=self.unhealthy())
        specs = build_specs(self.host, self.profiles, self.found, gen)
        kinds = {s.kind for s in specs}
        from devinject.specs.bundles import possible_bundle_kinds

        offered = {p.kind for p in self.profiles}
        offered |= possible_bundle_kinds(offered, gen.bundles)
        stale = tuple(sorted((self.written_kinds | offered) - kinds))
        write_specs(specs, self.opts.output_dir, self.opts.fmt, managed=True, stale_kinds=stale)
        self.written_kinds = kinds
        self.specs = specs
        self._write_health()
        from devinject.specs.generation import current

        self.generation = current(self.opts.output_dir)
        for listener in self.listeners:
            listener(self)
        return self.generation

    def _write_health(self) -> None:
        unhealthy_nodes = sorted({n for k, t in self.tracks.items() if t.published == UNHEALTHY and t.last
                                  for n in t.last.nodes})
        state = {"time": time.time(), "unhealthy_nodes": unhealthy_nodes,
                 "devices": {k: {"published": t.published, "status": t.last.status if t.last else None,
                                 "reasons": list(t.last.reasons) if t.last else []} for k, t in self.tracks.items()}}
        os.makedirs(self.opts.state_dir, exist_ok=True)
        jsonlite.replace_file(os.path.join(self.opts.state_dir, HEALTH_FILE), state, sort_keys=True)

    # --- the loop ------------------------------------------------------------------------------------
    def sweep_ledger(self) -> None:
        try:
            Ledger(self.opts.state_dir).sweep()
        except LedgerError as err:  # a busy or broken ledger is the hook's to handle; try again next round
            log.warning("ledger sweep: %s", err.message)

    def _uevent_listener(self, stop: threading.Event) -> None:
        try:
            from pyroute2 import UeventSocket

            sock = UeventSocket()
            sock.bind()
        except Exception as err:  # no netlink here (or no pyroute2): the periodic rescan still runs
            log.warning("kernel uevents unavailable (%s); rescanning every %gs", err, self.opts.rescan)
            return
        try:
            while not stop.is_set():
                ready, _, _ = select.select([sock], [], [], 0.5)
                if not ready:
                    continue
                if any(wants_rescan(message, self.uevent_subsystems) for message in sock.get()):
                    self.rescan_requested.set()
        finally:
            sock.close()

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        if self.opts.uevents:
            threading.Thread(target=self._uevent_listener, args=(stop,), name="uevents", daemon=True).start()
        self.rescan()
        self.check()
        self.write()
        events.record(self.opts.state_dir, "watch-started", devices=len(self.found), generation=self.generation)
        log.info("watching %d devices; specs in %s (generation %s)", len(self.found), self.opts.output_dir,
                 self.generation)
        next_rescan = time.monotonic() + self.opts.rescan
        while not stop.is_set():
            suspicious = any(t.fails or (t.published == UNHEALTHY and t.passes) for t in self.tracks.values())
            wait = self.opts.recheck if suspicious else self.opts.interval
            self.rescan_requested.wait(timeout=wait)
            if stop.is_set():
                break
            if self.rescan_requested.is_set():
                time.sleep(RESCAN_DEBOUNCE)  # let a burst of uevents (a card's functions) settle first
            inventory_changed = False
            if self.rescan_requested.is_set() or time.monotonic() >= next_rescan:
                self.rescan_requested.clear()
                inventory_changed = self.rescan()
                next_rescan = time.monotonic() + self.opts.rescan
            if self.check() or inventory_changed:
                self.write()
                log.info("specs rewritten (generation %s); unhealthy: %s", self.generation,
                         ", ".join(sorted(self.unhealthy())) or "none")
            self.sweep_ledger()

