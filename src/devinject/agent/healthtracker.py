"""The health state machine of `watch`'s loop: each device's track over the readings (`Verdict`s) the loop
hands it, what is published for it (taken out after `threshold` failures in a row, or at the first reading
that confirms the kernel's own statement; put back after `threshold` passes), and the state a restart must
not lose (`healthstate`: verdicts, the AER baselines and kernel-log position the readings rest on)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from devinject.agent import healthstate
from devinject.agent.health import HEALTHY, UNHEALTHY, AerBaseline, HealthChecker, Verdict, function_identity
from devinject.cdi.identity import DeviceKey, device_key, node_id_of, qualified
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.discovery.profiles import Profile
from devinject.nodestate import events

log = logging.getLogger("devinject.agent.watch")  # what the loop says, under the loop's name


@dataclass
class DeviceTrack:
    published: str = HEALTHY  # what the specs reflect
    fails: int = 0
    passes: int = 0
    last: Verdict | None = None
    observed: str = HEALTHY  # the latest verdict's status, published or not


def _plain(verdict: Verdict) -> str:
    """The verdict's reasons, without the device's own address in front of each."""
    prefix = f"{verdict.address}: "
    return "; ".join(r.removeprefix(prefix) for r in verdict.reasons) or verdict.status


class HealthTracker:
    """Each watched device's track (by its key, `kind=address`), judged from the readings of `checker`;
    `profiles`: the kinds watched (a persisted device of another kind is kept as it was, for the agent that
    watches it)."""

    def __init__(self, state_dir: str, threshold: int, profiles: list[Profile], checker: HealthChecker,
                 baseline: AerBaseline) -> None:
        self.state_dir = state_dir
        self.threshold = threshold
        self.profiles = profiles
        self.checker = checker
        self.baseline = baseline
        self.tracks: dict[str, DeviceTrack] = {}
        self.identities: dict[str, dict[str, str]] = {}  # device key -> its functions' identities
        self.distrusted: str | None = None  # why the persisted state was not believed
        self._foreign: dict[str, healthstate.TrackedDevice] = {}  # persisted devices of kinds not watched now
        self._saved: bytes | None = None
        self._save_error: str | None = None
        self._restore()

    # --- the state a restart must not lose -----------------------------------------------------------
    def _restore(self) -> None:
        """Start from the verdicts and readings an earlier agent persisted (healthstate): a device it took
        out is still out, AER totals are compared with its baselines, the kernel log is read on from where it
        stopped. A state file not to be believed holds every device out until it passes (`rediscovered`)."""
        try:
            state = healthstate.load_state(self.state_dir)
        except healthstate.Untrusted as err:
            moved = healthstate.move_aside(self.state_dir)
            log.error("health state not trusted: %s (%s); every device starts out of service, AER totals count "
                      "from zero and the whole kernel log is read", err, f"kept as {moved}" if moved else "left")
            events.record(self.state_dir, "health-state-rebuilt", reason=str(err), moved_to=moved)
            self.distrusted = str(err)
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

    def persist(self) -> None:
        """Write the state when it changed (fsynced, mode 0600); a failure is logged, and tried again."""
        devices = {key: healthstate.TrackedDevice(t.last.kind, t.last.address, t.published, t.observed,
                                                 t.last.reasons, t.last.nodes, self.identities.get(key, {}))
                   for key, t in self.tracks.items() if t.last is not None}
        identity, offset = self.checker.log_position()
        data = healthstate.encode_state(healthstate.HealthState(
            {**self._foreign, **devices}, dict(self.baseline.counts), identity, offset, self.checker.recent_errors()))
        if data == self._saved:
            return
        try:
            healthstate.save_state(self.state_dir, data)
        except OSError as err:
            if str(err) != self._save_error:
                log.error("%s: cannot persist the health state: %s", self.state_dir, err.strerror)
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
        events.record(self.state_dir, "cleared", key, by=by, functions=functions)

    def take_put_back_requests(self, found: list[FoundDevice]) -> None:
        """An admin's put-backs (`devinject put-back`, a request file in the state dir): the device's sticky
        readings cleared, so it goes back after `threshold` passes."""
        requests = healthstate.take_requests(self.state_dir)
        for key, accepted in requests.items():
            item = next((f for f in found if device_key(f.profile.kind, f.address) == key), None)
            if item is None and key not in self.tracks:
                log.warning("put-back request for %s: not a device this agent watches; ignored", key)
                continue
            functions = [pci.address for pci in item.functions] if item is not None else sorted(accepted)
            self._clear(key, functions, "put-back request", accepted)
            log.info("%s: put-back requested; back after %d passing checks", key, self.threshold)
        if requests:  # taken from their file: kept in the state before anything else can fail
            self.persist()

    # --- what a rescan found -------------------------------------------------------------------------
    def rediscovered(self, host: Host, found: Mapping[DeviceKey, FoundDevice], first: bool) -> None:
        """The devices a rescan found, by key: a function enumerated again (a new identity: removed and found
        again, a reboot) loses its sticky readings, it is a new device; at the first rescan after a state
        file that was not believed, every device is held out until it passes."""
        for key, item in sorted(found.items()):
            now = {pci.address: ident for pci in item.functions
                   if (ident := function_identity(host, pci)) is not None}
            known = self.identities.get(key, {})
            again = sorted(address for address, ident in now.items() if known.get(address, ident) != ident)
            if again:
                self._clear(key, again, "re-enumeration")
            self.identities[key] = {**known, **now}
            if first and self.distrusted is not None:
                self._hold_out(key, item)

    def _hold_out(self, key: str, item: FoundDevice) -> None:
        """After a state file that was not believed: out until `threshold` passes, AER history counting."""
        reason = f"health state not trusted ({self.distrusted}): out until its checks pass"
        nodes = tuple(node_id_of(n) for n in item.nodes)
        self.tracks[key] = DeviceTrack(published=UNHEALTHY,
                                       last=Verdict(key, item.profile.kind, item.address, UNHEALTHY, (reason,), nodes))
        for pci in item.functions:
            self.baseline.counts[pci.address] = (0, 0)
        events.record(self.state_dir, "taken-out", key, reasons=[reason])

    # --- the readings ----------------------------------------------------------------------------------
    def judge_round(self, verdicts: list[Verdict], found: list[FoundDevice]) -> bool:
        """A round's readings, a device tracked but not read now counted as gone (`definite`); True when what
        is published changed. The state is persisted."""
        present = {v.key for v in verdicts}
        verdicts = verdicts + [
            Verdict(key, t.last.kind, t.last.address, UNHEALTHY, (f"{t.last.address}: no longer present",),
                    t.last.nodes, definite=True)
            for key, t in self.tracks.items() if key not in present and t.last is not None]
        changed = False
        for verdict in verdicts:
            changed |= self.judge(verdict, found)
        self.persist()
        return changed

    def judge_announced(self, verdicts: list[Verdict], found: list[FoundDevice]) -> bool:
        """Readings taken out of band (the kernel announced a fault): only one that confirms the kernel's
        statement counts now, the rest is left to the rounds. True when what is published changed."""
        changed = False
        for verdict in verdicts:
            if verdict.status == UNHEALTHY and verdict.definite:
                changed |= self.judge(verdict, found)
        self.persist()
        return changed

    def judge(self, verdict: Verdict, found: list[FoundDevice]) -> bool:
        """One verdict counted for its device; True when what is published for it changed. A reading takes the
        device out after `threshold` failures in a row; the kernel's statement (`definite`) at the first."""
        track = self._observe(verdict)
        failing = verdict.status == UNHEALTHY
        track.fails, track.passes = (track.fails + 1, 0) if failing else (0, track.passes + 1)
        if track.published != UNHEALTHY and failing and (verdict.definite or track.fails >= self.threshold):
            track.published = UNHEALTHY
            events.record(self.state_dir, "taken-out", verdict.key, reasons=list(verdict.reasons),
                          at_once=verdict.definite)
            how = ("at once: the kernel's own statement" if verdict.definite else
                   f"after {track.fails} failed checks in a row")
            log.info("taking out %s: %s (%s)", self.describe(verdict, found), _plain(verdict), how)
            return True
        if track.published == UNHEALTHY and track.passes >= self.threshold:
            track.published = HEALTHY
            events.record(self.state_dir, "put-back", verdict.key, status=verdict.status)
            now = "healthy again" if verdict.status == HEALTHY else f"no longer failing ({_plain(verdict)})"
            log.info("putting back %s: %s, %d checks passed in a row", self.describe(verdict, found), now,
                     track.passes)
            return True
        return False

    def _observe(self, verdict: Verdict) -> DeviceTrack:
        """The device's track with `verdict` as its latest; every observed change is an event, debounced or
        not."""
        track = self.tracks.setdefault(verdict.key, DeviceTrack())
        if verdict.nodes or track.last is None:
            track.last = verdict
        else:  # keep the nodes we knew, so the ledger can still refuse them
            track.last = replace(verdict, nodes=track.last.nodes)
        if verdict.status != track.observed:
            events.record(self.state_dir, verdict.status, verdict.key, reasons=list(verdict.reasons),
                          previous=track.observed)
            track.observed = verdict.status
        return track

    def describe(self, verdict: Verdict, found: list[FoundDevice]) -> str:
        """`nvidia.com/gpu=0 (PCI 0000:18:00.0)`: the kind and the device's name in the specs (what
        `devinject put-back` takes), and its PCI address; the kind alone when it is not discovered now."""
        if any(p.kind == verdict.kind and p.channels is not None for p in self.profiles):
            return verdict.key  # a channel's key is its CDI name (`kind=N`); it has no PCI address
        item = next((f for f in found if f.profile.kind == verdict.kind and f.address == verdict.address), None)
        name = qualified(verdict.kind, str(item.index)) if item is not None else verdict.kind
        return f"{name} (PCI {verdict.address})"

    def unhealthy(self) -> frozenset[str]:
        """The keys of the devices taken out."""
        return frozenset(k for k, t in self.tracks.items() if t.published == UNHEALTHY)

    def suspicious(self) -> bool:
        """A device failing, or out and passing: the loop rechecks sooner."""
        return any(t.fails or (t.published == UNHEALTHY and t.passes) for t in self.tracks.values())
