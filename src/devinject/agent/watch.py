"""`devinject watch`: keep the CDI specs true to the hardware.

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
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field, replace
from pathlib import Path
from typing import Any

from devinject.agent import healthstate
from devinject.agent.channels import channel_verdicts
from devinject.agent.health import (
    HEALTHY,
    UNHEALTHY,
    AerBaseline,
    HealthChecker,
    Verdict,
    function_identity,
    unbound_functions,
    unbound_verdict,
)
from devinject.agent.kernelmsg import AUTO, describe
from devinject.core import atomicfile, jsonlite
from devinject.core.errors import LedgerError
from devinject.core.identity import device_key, node_id_of, qualified
from devinject.core.model import Spec
from devinject.core.paths import DEFAULT_STATE_DIR, DYNAMIC_SPEC_DIR
from devinject.discovery.channels import ChannelDevice
from devinject.discovery.discover import FoundDevice
from devinject.discovery.node import Node
from devinject.nodestate import events
from devinject.nodestate.ledger import HEALTH_FILE, Ledger
from devinject.specs.generate import GenerateOptions, build_specs, kind_profiles, served_devices, write_specs

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


def _plain(verdict: Verdict) -> str:
    """The verdict's reasons, without the device's own address in front of each."""
    prefix = f"{verdict.address}: "
    return "; ".join(r.removeprefix(prefix) for r in verdict.reasons) or verdict.status


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


@dataclass
class DeviceTrack:
    published: str = HEALTHY  # what the specs reflect
    fails: int = 0
    passes: int = 0
    last: Verdict | None = None
    observed: str = HEALTHY  # the latest verdict's status, published or not


def watched_node(opts: WatchOptions) -> Node:
    """The node `opts` describe (its host root, target root, profile dirs, state dir, kernel log), unchecked:
    a command checks the roots when it makes its own node and hands that to the Watcher."""
    gen = opts.generate
    return Node(gen.root, target_root=gen.target_root, profile_dirs=gen.profile_dirs, state_dir=opts.state_dir,
                kernel_log=opts.kernel_log, check=False)


@dataclass
class Watcher:
    """`watch`'s loop over one node (devinject.discovery.node.Node): its profiles, loaded once when the
    watcher is made, and its devices, discovered again on each rescan (`Node.rescanned`). `node`: the node a
    command made (roots checked); by default the one `opts` describe."""

    opts: WatchOptions
    tracks: dict[str, DeviceTrack] = field(default_factory=dict)
    found: list[FoundDevice] = field(default_factory=list)
    channels: list[ChannelDevice] = field(default_factory=list)  # of the served kinds (IMEX channels)
    unbound: list[Verdict] = field(default_factory=list)
    generation: int | None = None
    specs: list[Spec] = field(default_factory=list)  # as last written
    listeners: list[Callable[[Watcher], None]] = field(default_factory=list)  # told after every write
    loop_lock: int | None = None  # the state dir's health-loop lock (healthstate.take_loop_lock), once taken
    node: InitVar[Node | None] = None

    def __post_init__(self, node: Node | None) -> None:
        self.scanned = node or watched_node(self.opts)  # the node as the last rescan read it
        self.host = self.scanned.host  # the same Host across rescans: each refreshes it
        self.profiles = kind_profiles(self.scanned.profiles, self.opts.generate)
        self.uevent_subsystems = frozenset(BASE_UEVENTS).union(*(p.uevents for p in self.profiles))
        self.baseline = AerBaseline()
        self.checker = HealthChecker(self.host, kernel_log=self.opts.kernel_log, timeout=self.opts.probe_timeout,
                                     baseline=self.baseline)
        self.written_kinds: set[str] = set()
        self.rescan_requested = threading.Event()
        self.wake = threading.Event()  # set by the uevent and kernel-log threads: something to look at now
        self._announced: set[str] = set()  # PCI functions a uevent said were unbound or removed
        self._log_grew = False  # the kernel log changed since the loop last read it
        self._lock = threading.Lock()  # guards the two above
        self.identities: dict[str, dict[str, str]] = {}  # device key -> its functions' identities
        self._rescanned = False
        self.sweep_left_to_hooks = False  # the ledger is another pid namespace's (said once in the log)
        self._distrusted: str | None = None  # why the persisted state was not believed
        self._foreign: dict[str, healthstate.DeviceRecord] = {}  # persisted devices of kinds not watched now
        self._saved: bytes | None = None
        self._save_error: str | None = None
        self._health_written: tuple[list[str], dict[str, Any]] | None = None  # health.json as last written
        self._restore()

    # --- the state a restart must not lose -----------------------------------------------------------
    def _restore(self) -> None:
        """Start from the verdicts and readings an earlier agent persisted (healthstate): a device it took
        out is still out, AER totals are compared with its baselines, the kernel log is read on from where it
        stopped. A state file not to be believed holds every device out until it passes (see `rescan`)."""
        try:
            state = healthstate.load_state(self.opts.state_dir)
        except healthstate.Untrusted as err:
            moved = healthstate.move_aside(self.opts.state_dir)
            log.error("health state not trusted: %s (%s); every device starts out of service, AER totals count "
                      "from zero and the whole kernel log is read", err, f"kept as {moved}" if moved else "left")
            events.record(self.opts.state_dir, "health-state-rebuilt", reason=str(err), moved_to=moved)
            self._distrusted = str(err)
            self.checker.resume(None, 0, {})
            return
        if state is None:
            return
        kinds = {p.kind for p in self.profiles}
        for key, record in state.devices.items():
            if record.kind not in kinds:  # not watched by this agent: kept as it was for one that does
                self._foreign[key] = record
                continue
            last = Verdict(key, record.kind, record.address, record.observed, record.reasons, record.nodes)
            self.tracks[key] = DeviceTrack(published=record.published, last=last, observed=record.observed)
            self.identities[key] = dict(record.functions)
        self.baseline.counts.update(state.aer)
        self.checker.resume(state.log_identity, state.log_offset, state.log_errors)

    def _persist(self) -> None:
        """Write the state when it changed (fsynced, mode 0600); a failure is logged, and tried again."""
        devices = {key: healthstate.DeviceRecord(t.last.kind, t.last.address, t.published, t.observed,
                                                 t.last.reasons, t.last.nodes, self.identities.get(key, {}))
                   for key, t in self.tracks.items() if t.last is not None}
        identity, offset = self.checker.log_position()
        data = healthstate.encode_state(healthstate.HealthState(
            {**self._foreign, **devices}, dict(self.baseline.counts), identity, offset, self.checker.recent_errors()))
        if data == self._saved:
            return
        try:
            healthstate.save_state(self.opts.state_dir, data)
        except OSError as err:
            if str(err) != self._save_error:
                log.error("%s: cannot persist the health state: %s", self.opts.state_dir, err.strerror)
            self._save_error = str(err)
            return
        self._saved, self._save_error = data, None

    def _clear(self, key: str, functions: list[str], by: str,
               accepted: dict[str, tuple[int, int]] | None = None) -> None:
        """Drop the sticky readings of `functions` (AER baselines, kernel-log errors of their slots): the
        device is judged afresh, and goes back after `threshold` passes if it was out. `accepted`: the AER
        totals to take as the new baseline (an admin's put-back); otherwise the next reading is."""
        for address in functions:
            if accepted and address in accepted:
                self.baseline.counts[address] = accepted[address]
            else:
                self.baseline.counts.pop(address, None)
            self.checker.clear_xids(address)
        events.record(self.opts.state_dir, "cleared", key, by=by, functions=functions)

    def _take_put_back_requests(self) -> None:
        requests = healthstate.take_requests(self.opts.state_dir)
        for key, accepted in requests.items():
            found = next((f for f in self.found if device_key(f.profile.kind, f.address) == key), None)
            if found is None and key not in self.tracks:
                log.warning("put-back request for %s: not a device this agent watches; ignored", key)
                continue
            functions = [pci.address for pci in found.functions] if found is not None else sorted(accepted)
            self._clear(key, functions, "put-back request", accepted)
            log.info("%s: put-back requested; back after %d passing checks", key, self.opts.threshold)
        if requests:  # taken from their file: kept in the state before anything else can fail
            self._persist()

    # --- one round -----------------------------------------------------------------------------------
    def rescan(self) -> bool:
        """Rediscover; returns True when the set of devices changed. A function enumerated again (a new
        identity: removed and found again, a reboot) loses its sticky readings: it is a new device."""
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
        for key, item in sorted(after.items()):
            now = {pci.address: ident for pci in item.functions
                   if (ident := function_identity(self.host, pci)) is not None}
            known = self.identities.get(key, {})
            again = sorted(address for address, ident in now.items() if known.get(address, ident) != ident)
            if again:
                self._clear(key, again, "re-enumeration")
            self.identities[key] = {**known, **now}
            if first and self._distrusted is not None:
                self._hold_out(key, item)
        for key in sorted(before - present):
            events.record(self.opts.state_dir, "removed", key)
        self.found, self.channels = found, channels
        self.unbound = [unbound_verdict(p, pci) for p, pci in unbound_functions(self.host, self.profiles)]
        self._persist()
        return present != before

    def _hold_out(self, key: str, item: FoundDevice) -> None:
        """After a state file that was not believed: out until `threshold` passes, AER history counting."""
        reason = f"health state not trusted ({self._distrusted}): out until its checks pass"
        nodes = tuple(node_id_of(n) for n in item.nodes)
        self.tracks[key] = DeviceTrack(published=UNHEALTHY,
                                       last=Verdict(key, item.profile.kind, item.address, UNHEALTHY, (reason,), nodes))
        for pci in item.functions:
            self.baseline.counts[pci.address] = (0, 0)
        events.record(self.opts.state_dir, "taken-out", key, reasons=[reason])

    def check(self) -> bool:
        """Health round; returns True when the published state changed (specs must be rewritten)."""
        self._take_put_back_requests()
        self.host.refresh()
        verdicts = self.checker.check(self.found) + self.unbound + channel_verdicts(self.host, self.channels)
        present = {v.key for v in verdicts}
        verdicts += [Verdict(key, t.last.kind, t.last.address, UNHEALTHY, (f"{t.last.address}: no longer present",),
                             t.last.nodes, definite=True)
                     for key, t in self.tracks.items() if key not in present and t.last is not None]
        changed = False
        for verdict in verdicts:
            changed |= self._judge(verdict)
        self._persist()
        if self._health_written is not None:  # a verdict the readers show changed: tell them (list, health)
            self._write_health(only_if_changed=True)
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
        changed = False
        for verdict in self.checker.check(targets, read_log=False):
            if verdict.status == UNHEALTHY and verdict.definite:
                changed |= self._judge(verdict)
        self._persist()
        return changed

    def _judge(self, verdict: Verdict) -> bool:
        """One verdict counted for its device; True when what is published for it changed. A reading takes the
        device out after `threshold` failures in a row; the kernel's statement (`definite`) at the first."""
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
        if track.published != UNHEALTHY and failing and (verdict.definite or track.fails >= self.opts.threshold):
            track.published = UNHEALTHY
            events.record(self.opts.state_dir, "taken-out", verdict.key, reasons=list(verdict.reasons),
                          at_once=verdict.definite)
            how = ("at once: the kernel's own statement" if verdict.definite else
                   f"after {track.fails} failed checks in a row")
            log.info("taking out %s: %s (%s)", self._describe(verdict), _plain(verdict), how)
            return True
        if track.published == UNHEALTHY and track.passes >= self.opts.threshold:
            track.published = HEALTHY
            events.record(self.opts.state_dir, "put-back", verdict.key, status=verdict.status)
            now = "healthy again" if verdict.status == HEALTHY else f"no longer failing ({_plain(verdict)})"
            log.info("putting back %s: %s, %d checks passed in a row", self._describe(verdict), now, track.passes)
            return True
        return False

    def _describe(self, verdict: Verdict) -> str:
        """`nvidia.com/gpu=0 (PCI 0000:18:00.0)`: the kind and the device's name in the specs (what
        `devinject put-back` takes), and its PCI address; the kind alone when it is not discovered now."""
        if any(p.kind == verdict.kind and p.channels is not None for p in self.profiles):
            return verdict.key  # a channel's key is its CDI name (`kind=N`); it has no PCI address
        found = next((f for f in self.found if f.profile.kind == verdict.kind and f.address == verdict.address),
                     None)
        name = qualified(verdict.kind, str(found.index)) if found is not None else verdict.kind
        return f"{name} (PCI {verdict.address})"

    def unhealthy(self) -> frozenset[str]:
        return frozenset(k for k, t in self.tracks.items() if t.published == UNHEALTHY)

    def write(self) -> int | None:
        if not self.opts.specs:  # health.json alone: what the hook, the ledger and the listeners read
            self._write_health()
            self._write_features()
            for listener in self.listeners:
                listener(self)
            return self.generation
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
        self._write_features()
        from devinject.specs.generation import current

        self.generation = current(self.opts.output_dir)
        for listener in self.listeners:
            listener(self)
        return self.generation

    def _write_features(self) -> None:
        """The node's labels for NFD (agent/nfd.py), devices taken out not counted; a failed write is logged,
        the specs already written stand."""
        if not self.opts.nfd_features_dir:
            return
        from devinject.agent.nfd import features, write_features

        try:
            if write_features(self.opts.nfd_features_dir, features(self.host, self.found, out=self.unhealthy())):
                log.info("wrote the node's labels for NFD in %s", self.opts.nfd_features_dir)
        except OSError as err:
            log.warning("%s: cannot write NFD's feature file: %s", self.opts.nfd_features_dir, err.strerror)

    def _write_health(self, *, only_if_changed: bool = False) -> None:
        """health.json: what the ledger refuses (`unhealthy_nodes`) and each device's published verdict with
        its latest check, which `list` and `health` show. Written with the specs, and after a round whose
        verdicts changed (`only_if_changed`), so that a reader never shows an older check than the agent's."""
        unhealthy_nodes = sorted({n for k, t in self.tracks.items() if t.published == UNHEALTHY and t.last
                                  for n in t.last.nodes})
        devices = {k: {"published": t.published, "status": t.last.status if t.last else None,
                       "reasons": list(t.last.reasons) if t.last else []} for k, t in self.tracks.items()}
        if only_if_changed and (unhealthy_nodes, devices) == self._health_written:
            return
        self._health_written = (unhealthy_nodes, devices)
        state = {"time": time.time(), "unhealthy_nodes": unhealthy_nodes, "devices": devices}
        os.makedirs(self.opts.state_dir, mode=0o755, exist_ok=True)
        atomicfile.replace(os.path.join(self.opts.state_dir, HEALTH_FILE),
                           jsonlite.dumps(state, sort_keys=True).encode(), 0o644)

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
        next_rescan = time.monotonic() + self.opts.rescan
        while not stop.is_set():
            suspicious = any(t.fails or (t.published == UNHEALTHY and t.passes) for t in self.tracks.values())
            due = time.monotonic() + (self.opts.recheck if suspicious else self.opts.interval)
            while not stop.is_set() and not self.rescan_requested.is_set() and time.monotonic() < due:
                self.wake.wait(timeout=max(0.0, due - time.monotonic()))
                self.wake.clear()
                self._announcements()  # between rounds: the rounds keep their own pace
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
        self.checker.log.close()  # a journal follower is a child process
