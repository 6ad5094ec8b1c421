"""`devinject watch`: keep the CDI specs true to the hardware. This module is the loop (the scheduler: its
timers, the uevent listener, the kernel-log follower); each device's health is judged by the tracker
(agent/healthtracker.py), and a round's result goes to the publishers (agent/publishers.py: the specs,
health.json, NFD's labels, then the device plugin's or the DRA driver's own).

Rescans on kernel uevents (netlink, via pyroute2) and periodically as a safety net; polls health every
`interval` seconds, re-checks a failing device every `recheck` seconds, and acts on a reading only after
`threshold` consecutive failures (or passes, to put a device back), so one glitch does not flap. A fault the
kernel announces is acted on as it happens, between rounds: a line in the kernel log naming a device (followed
with one stat every LOG_POLL seconds), a PCI `unbind` or `remove` uevent; the device named is checked at once
and, if the check confirms the kernel's statement (a fatal Xid logged, the driver unbound, the function gone:
`Verdict.definite`), taken out in that check, without rechecks. What it has judged, and the readings its
verdicts rest on, outlive the process (`healthstate`): a restarted agent starts from them, so a device taken
out stays out until re-enumeration or an admin's put-back clears it.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devinject.agent import healthstate
from devinject.agent.channels import channel_verdicts
from devinject.agent.health import AerBaseline, HealthChecker, Verdict, unbound_functions, unbound_verdict
from devinject.agent.healthtracker import DeviceTrack, HealthTracker
from devinject.agent.kernelmsg import AUTO, describe
from devinject.agent.publishers import HealthFile, RoundPublisher, SpecFiles, default_publishers
from devinject.cdi.identity import device_key
from devinject.cdi.model import Spec
from devinject.core.errors import LedgerError
from devinject.core.paths import DEFAULT_STATE_DIR, DYNAMIC_SPEC_DIR
from devinject.discovery.channels import ChannelDevice
from devinject.discovery.discover import FoundDevice
from devinject.discovery.node import Node
from devinject.nodestate import events
from devinject.nodestate.ledger import Ledger
from devinject.specs.generate import GenerateOptions, kind_profiles, served_devices

__all__ = ["DeviceTrack", "WatchOptions", "Watcher", "announced_address", "wants_rescan", "watched_node"]

log = logging.getLogger(__name__)

RESCAN_DEBOUNCE = 0.2
LOG_POLL = 0.2  # seconds between looks (one stat) at the kernel log's size: no inotify in the stdlib
BASE_UEVENTS = ("pci",)  # a function appearing or going: every family; the rest come from the profiles


def wants_rescan(message: Any, subsystems: tuple[str, ...] | frozenset[str] = BASE_UEVENTS) -> bool:
    """A kernel uevent about a subsystem whose devices we offer (add/remove/bind/unbind/change)."""
    try:
        return str(message.get("SUBSYSTEM", "")) in subsystems
    except AttributeError:
        return False


def announced_address(message: Any) -> str | None:
    """The PCI function a uevent says was unbound from its driver or removed (`PCI_SLOT_NAME`, else the last
    component of `DEVPATH`); None for any other uevent."""
    try:
        if str(message.get("SUBSYSTEM", "")) != "pci" or str(message.get("ACTION", "")) not in ("unbind", "remove"):
            return None
        address = str(message.get("PCI_SLOT_NAME") or str(message.get("DEVPATH", "")).rpartition("/")[2])
    except AttributeError:
        return None
    return address.lower() or None


@dataclass(frozen=True)
class WatchOptions:
    generate: GenerateOptions
    output_dir: Path = Path(DYNAMIC_SPEC_DIR)
    state_dir: str = DEFAULT_STATE_DIR
    fmt: str = "yaml"
    interval: float = 10.0
    recheck: float = 1.5
    threshold: int = 3
    rescan: float = 60.0
    kernel_log: str = AUTO
    probe_timeout: float = 2.0
    uevents: bool = True
    nfd_features_dir: str | None = None  # write NFD's feature file there (agent/nfd.py)
    specs: bool = True  # write the kinds' CDI specs; the DRA driver's loop writes none (its claims have their own)


def watched_node(opts: WatchOptions) -> Node:
    """The node `opts` describe (its host root, target root, profile dirs, state dir, kernel log), unchecked:
    a command checks the roots when it makes its own node and hands that to the Watcher."""
    gen = opts.generate
    return Node(gen.root, target_root=gen.target_root, profile_dirs=gen.profile_dirs, state_dir=opts.state_dir,
                kernel_log=opts.kernel_log, check=False, nvml=gen.nvml, driver_root=gen.driver_root)


class Watcher:
    """`watch`'s loop over one node (devinject.discovery.node.Node): its profiles, loaded once when the
    watcher is made, and its devices, discovered again on each rescan (`Node.rescanned`). `node`: the node a
    command made (roots checked); by default the one `opts` describe. Each round's readings go to the tracker
    (`tracker`), its result to the publishers (`publishers`: the node's files, then whoever appends one)."""

    def __init__(self, opts: WatchOptions, *, node: Node | None = None, loop_lock: int | None = None) -> None:
        self.opts = opts
        self.loop_lock = loop_lock  # the state dir's health-loop lock (healthstate.take_loop_lock), once taken
        self.scanned = node or watched_node(opts)  # the node as the last rescan read it
        self.host = self.scanned.host  # the same Host across rescans: each refreshes it
        self.profiles = kind_profiles(self.scanned.profiles, opts.generate)
        self.uevent_subsystems = frozenset(BASE_UEVENTS).union(*(p.uevents for p in self.profiles))
        self.found: list[FoundDevice] = []
        self.channels: list[ChannelDevice] = []  # of the served kinds (IMEX channels)
        self.unbound: list[Verdict] = []
        baseline = AerBaseline()
        self.checker = HealthChecker(self.host, kernel_log=opts.kernel_log, timeout=opts.probe_timeout,
                                     baseline=baseline)
        self.tracker = HealthTracker(opts.state_dir, opts.threshold, self.profiles, self.checker, baseline)
        self.health_file = HealthFile(opts.state_dir)
        self.publishers: list[RoundPublisher] = default_publishers(
            opts.generate, opts.output_dir if opts.specs else None, opts.fmt, self.health_file, opts.nfd_features_dir)
        self.rescan_requested = threading.Event()
        self.wake = threading.Event()  # set by the uevent and kernel-log threads: something to look at now
        self._announced: set[str] = set()  # PCI functions a uevent said were unbound or removed
        self._log_grew = False  # the kernel log changed since the loop last read it
        self._lock = threading.Lock()  # guards the two above
        self._rescanned = False
        self.sweep_left_to_hooks = False  # the ledger is another pid namespace's (said once in the log)

    @property
    def tracks(self) -> dict[str, DeviceTrack]:
        return self.tracker.tracks

    @property
    def _spec_files(self) -> SpecFiles | None:
        return next((p for p in self.publishers if isinstance(p, SpecFiles)), None)

    @property
    def specs(self) -> list[Spec]:
        """The specs as last written (none when the loop writes none)."""
        files = self._spec_files
        return files.specs if files is not None else []

    @property
    def generation(self) -> int | None:
        files = self._spec_files
        return files.generation if files is not None else None

    # --- one round -----------------------------------------------------------------------------------
    def rescan(self) -> bool:
        """Rediscover; returns True when the set of devices changed (the tracker judges a function
        enumerated again as a new device)."""
        self.scanned = self.scanned.rescanned()
        _, found = served_devices(self.scanned, self.opts.generate)
        kinds = {p.kind for p in self.profiles}
        channels = [c for c in self.scanned.channels() if c.profile.kind in kinds]
        first, self._rescanned = not self._rescanned, True
        before = {device_key(f.profile.kind, f.address) for f in self.found} | {c.key for c in self.channels}
        after = {device_key(f.profile.kind, f.address): f for f in found}
        present = set(after) | {c.key for c in channels}
        for key in sorted(present - before):
            if not first:
                events.record(self.opts.state_dir, "added", key)
        self.tracker.rediscovered(self.host, after, first)
        for key in sorted(before - present):
            events.record(self.opts.state_dir, "removed", key)
        self.found, self.channels = found, channels
        self.unbound = [unbound_verdict(p, pci) for p, pci in unbound_functions(self.host, self.profiles)]
        self.tracker.persist()
        return present != before

    def check(self) -> bool:
        """Health round; returns True when the published state changed (specs must be rewritten)."""
        self.tracker.take_put_back_requests(self.found)
        self.host.refresh()
        verdicts = self.checker.check(self.found) + self.unbound + channel_verdicts(self.host, self.channels)
        changed = self.tracker.judge_round(verdicts, self.found)
        self.health_file.refresh(self.tracks)  # a verdict the readers show changed: tell them (list, health)
        return changed

    def check_announced(self, addresses: frozenset[str] = frozenset()) -> bool:
        """Out of band, between rounds: read the kernel log, and check at once the devices it names with a new
        error code or that have a function in `addresses` (a uevent said unbound or removed). A verdict that
        confirms the kernel's statement (`definite`) takes the device out now; anything else is left to the
        rounds, so no device is judged more often than they judge it. Returns True when the published state
        changed."""
        self.host.refresh()
        slots = self.checker.read_log(self.found)
        targets = [f for f in self.found
                   if any(p.address in addresses or p.address.rpartition(".")[0] in slots for p in f.functions)]
        if not targets:  # a chatty log: nothing to persist until the next round (no fsync per line)
            return False
        return self.tracker.judge_announced(self.checker.check(targets, read_log=False), self.found)

    def unhealthy(self) -> frozenset[str]:
        return self.tracker.unhealthy()

    def write(self) -> int | None:
        """Tell every publisher (the specs, health.json, ..., then those appended); the specs' generation."""
        for publisher in self.publishers:
            publisher(self)
        return self.generation

    # --- the loop ------------------------------------------------------------------------------------
    def sweep_ledger(self) -> None:
        try:
            swept = Ledger(self.opts.state_dir).sweep()
        except LedgerError as err:  # a busy or broken ledger is the hook's to handle; try again next round
            log.warning("ledger sweep: %s", err.message)
            return
        if not swept and not self.sweep_left_to_hooks:
            self.sweep_left_to_hooks = True  # said once: it is how an agent pod without hostPID runs
            log.info("ledger sweep left to the hooks: the ledger counts the node's pids, and this agent runs in "
                     "a pid namespace of its own")

    def uevent(self, message: Any) -> None:
        """A kernel uevent (from the listener thread): an unbind or removal of a PCI function is checked at
        once; any event of a subsystem we offer asks for a rescan."""
        address = announced_address(message)
        if address is not None:
            with self._lock:
                self._announced.add(address)
        if address is not None or wants_rescan(message, self.uevent_subsystems):
            self.rescan_requested.set()
            self.wake.set()

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
                if ready:
                    for message in sock.get():
                        self.uevent(message)
        finally:
            sock.close()

    def _log_follower(self, stop: threading.Event) -> None:
        """Wake the loop when the kernel's messages grew (a file: one stat per LOG_POLL; the ring buffer: a
        poll the kernel wakes at once); the loop reads them. Also wakes it when told to stop."""
        follow = any(p.kernel_log for p in self.profiles)
        wait = getattr(self.checker.log, "wait", None)
        while not stop.is_set():
            if follow and wait is not None:
                grew = wait(LOG_POLL)
            else:
                grew = not stop.wait(LOG_POLL) and follow and self.checker.log.pending()
            if grew and not stop.is_set():
                with self._lock:
                    self._log_grew = True
                self.wake.set()
                stop.wait(0.01)  # the loop reads what woke us before the next look
        self.wake.set()

    def _say_written(self) -> None:
        unhealthy = ", ".join(sorted(self.unhealthy())) or "none"
        if self.opts.specs:
            log.info("specs rewritten (generation %s); unhealthy: %s", self.generation, unhealthy)
        else:
            log.info("health rewritten; unhealthy: %s", unhealthy)

    def _announcements(self) -> bool:
        """Act on what the threads announced since the last look; True when the specs were rewritten."""
        with self._lock:
            addresses, grew = frozenset(self._announced), self._log_grew
            self._announced, self._log_grew = set(), False
        if not (addresses or grew) or not self.check_announced(addresses):
            return False
        self.write()
        self._say_written()
        return True

    def announce_kernel_source(self) -> None:
        """Say at start where the kernel's messages (Xids) are read from, and warn when they cannot be: then
        an Xid reaches the agent only as the fault it causes (a function gone, unbound), if at all."""
        if not any(p.kernel_log for p in self.profiles):
            return
        description, readable = describe(self.checker.log)
        if readable:
            log.info("kernel messages from %s (--kernel-log %s)", description, self.opts.kernel_log)
        else:
            log.warning("no kernel messages: %s cannot be read (--kernel-log %s); Xids are not seen",
                        description, self.opts.kernel_log)

    def claim_state_dir(self) -> bool:
        """Take the state dir's health-loop lock (kept while the process lives); False when another process's
        loop holds it."""
        if self.loop_lock is None:
            self.loop_lock = healthstate.take_loop_lock(self.opts.state_dir)
        return self.loop_lock is not None

    def release_state_dir(self) -> None:
        """Let the health-loop lock go (the loop has stopped)."""
        if self.loop_lock is not None:
            os.close(self.loop_lock)
            self.loop_lock = None

    def run(self, stop: threading.Event | None = None) -> None:
        try:
            self._run(stop or threading.Event())
        finally:
            self.release_state_dir()

    def wait_for_state_dir(self, stop: threading.Event, patience: float = 20.0) -> bool:
        """The state dir's loop lock, asked for (healthstate.ask_for_loop) for up to `patience` seconds: a
        `dra-driver --health auto` that took the loop over while this agent was down hands it back. True once
        this process holds it."""
        deadline = time.monotonic() + patience
        try:
            while not stop.is_set():
                healthstate.ask_for_loop(self.opts.state_dir)
                if self.claim_state_dir():
                    return True
                if time.monotonic() >= deadline:
                    return False
                stop.wait(0.25)
            return False
        finally:
            healthstate.withdraw_loop_request(self.opts.state_dir)

    def _run(self, stop: threading.Event) -> None:
        self._start(stop)
        next_rescan = time.monotonic() + self.opts.rescan
        while not stop.is_set():
            due = time.monotonic() + (self.opts.recheck if self.tracker.suspicious() else self.opts.interval)
            self._wait_for_round(stop, due)
            if stop.is_set():
                break
            if self.rescan_requested.is_set():
                self._announcements()  # an unbind is checked before the debounce, not after it
                time.sleep(RESCAN_DEBOUNCE)  # let a burst of uevents (a card's functions) settle first
            inventory_changed = False
            if self.rescan_requested.is_set() or time.monotonic() >= next_rescan:
                self.rescan_requested.clear()
                inventory_changed = self.rescan()
                next_rescan = time.monotonic() + self.opts.rescan
            if self.check() or inventory_changed:
                self.write()
                self._say_written()
            self.sweep_ledger()
            self._claim_state_dir_again()
        self.checker.log.close()  # a journal follower is a child process

    def _claim_state_dir_again(self) -> None:
        """Started beside another loop (the pod a rolling update replaces holds the state dir until it stops):
        the lock is this loop's once that one lets it go, asked for meanwhile, so that a `dra-driver --health
        auto` does not take it over and leave two loops on the state dir."""
        if self.loop_lock is not None:
            return
        if self.claim_state_dir():
            healthstate.withdraw_loop_request(self.opts.state_dir)
            log.info("the health loop on %s is this agent's alone now", self.opts.state_dir)
        else:
            healthstate.ask_for_loop(self.opts.state_dir)

    def _start(self, stop: threading.Event) -> None:
        """The state dir's loop lock, the listener threads, the first rescan, round and write."""
        self.announce_kernel_source()
        if not self.claim_state_dir() and not self.wait_for_state_dir(stop):
            log.warning("another health loop runs on %s: both rewrite its health state and take its put-back "
                        "requests; run one agent's loop per state dir (dra-driver --health follow beside this one)",
                        self.opts.state_dir)
        if self.opts.uevents:
            threading.Thread(target=self._uevent_listener, args=(stop,), name="uevents", daemon=True).start()
        threading.Thread(target=self._log_follower, args=(stop,), name="kernel-log", daemon=True).start()
        self.rescan()
        self.check()
        self.write()
        events.record(self.opts.state_dir, "watch-started", devices=len(self.found), generation=self.generation)
        if self.opts.specs:
            log.info("watching %d devices; specs in %s (generation %s)", len(self.found), self.opts.output_dir,
                     self.generation)
        else:
            log.info("watching %d devices; health in %s", len(self.found), self.opts.state_dir)

    def _wait_for_round(self, stop: threading.Event, due: float) -> None:
        """Until the round is due (or a rescan asked for, or stop): what the threads announce meanwhile is
        acted on as it comes, the rounds keeping their own pace."""
        while not stop.is_set() and not self.rescan_requested.is_set() and time.monotonic() < due:
            self.wake.wait(timeout=max(0.0, due - time.monotonic()))
            self.wake.clear()
            self._announcements()
