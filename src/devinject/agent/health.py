"""Device health: `healthy`, `degraded` or `unhealthy`, each with reasons, from what the kernel shows.

Sources (all under the host root): the PCI function's presence, driver binding, `enable`, PCIe link
width/speed against the maximum, AER counters, the driver's own flags and the fatal errors it logs in the kernel
log. Every probe runs with a deadline: a read that hangs (a driver file of a dead device) becomes
`unhealthy: probe timed out`.

Two kinds of failure: a *reading* (AER counters, link width and speed, `enable`, the driver's flag, a probe
that timed out) may be noise and is confirmed by `watch` over `--threshold` checks; a *statement* by the kernel
(a fatal error it logged, the function unbound from its driver or gone from the bus) is `definite` and acted
on at once.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from devinject.agent.kernelmsg import AUTO, KernelMessages, open_source
from devinject.agent.kernelmsg import KernelLog as KernelLog  # re-exported: the file follower
from devinject.cdi.identity import device_key, node_id_of
from devinject.core.paths import DEFAULT_KERNEL_LOG as DEFAULT_KERNEL_LOG  # the one definition, re-exported
from devinject.discovery.discover import FoundDevice, family_of
from devinject.discovery.gpuinfo import ProbeTimeout, call_with_timeout
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.discovery.procfs import parse_key_values
from devinject.discovery.profiles import Profile, select_profile
from devinject.discovery.sysfs import PciDevice, scan_pci

HEALTHY, DEGRADED, UNHEALTHY = "healthy", "degraded", "unhealthy"
_RANK = {HEALTHY: 0, DEGRADED: 1, UNHEALTHY: 2}
PROBE_TIMEOUT = 2.0
_SPEED = re.compile(r"([\d.]+)\s*GT/s")


@dataclass(frozen=True, slots=True)
class Verdict:
    key: str  # kind=pci-address: stable across renames and index shifts
    kind: str
    address: str
    status: str
    reasons: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()  # "c 195:2": what the ledger refuses while unhealthy
    definite: bool = False  # unhealthy by the kernel's own statement (fatal error logged, unbound, gone)

    @property
    def healthy(self) -> bool:
        return self.status == HEALTHY


@dataclass(frozen=True)
class PutBack:
    """An admin's put-back as a one-shot check honours it (agent/healthstate.py keeps them): the AER totals
    accepted per function, and where the kernel's messages stood (the source's `position()`): an error
    logged before it does not count."""

    time: float
    aer: dict[str, tuple[int, int]]
    log_identity: str | None
    log_offset: int | None


@dataclass
class AerBaseline:
    """AER totals seen earlier, so `watch` reacts to counters increasing rather than to history."""

    counts: dict[str, tuple[int, int]] = field(default_factory=dict)


def function_identity(host: Host, pci: PciDevice) -> str | None:
    """Which enumeration of a PCI function this is: the boot and its sysfs directory's inode (the kernel gives
    a function that is removed and found again a new one; a reboot finds every function again). None when the
    directory cannot be read (the function is gone)."""
    try:
        inode = os.stat(host.real(pci.sys_path)).st_ino
    except OSError:
        return None
    boot = host.read_attr("/proc/sys/kernel/random/boot_id") or "-"
    return f"{boot}:{inode}"


@dataclass(frozen=True, slots=True)
class Fault:
    """What a reason of a verdict says, in words a scheduler can carry: `cause` a DNS label naming the fault
    (`xid`, `aer-fatal`, `unbound`, `gone`, `link`, ...), `detail` its particular (the Xid code, the AER total,
    the driver the function is bound to instead), `fatal` whether the device is lost until it is reset
    (a fatal error the driver logged, AER fatal errors, the function gone from the bus)."""

    cause: str
    detail: str = ""
    fatal: bool = False


_FAULTS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], Fault]], ...] = (
    (re.compile(r"gone from the PCI bus$|no longer present$|: no such node$"), lambda m: Fault("gone", fatal=True)),
    (re.compile(r"fatal (?P<name>\S+) (?P<code>\d+)$"),
     lambda m: Fault(m["name"].lower(), m["code"], fatal=True)),  # `fatal Xid 79`: the profile's kernel-log name
    (re.compile(r"AER fatal errors \d+ -> (?P<total>\d+)$"), lambda m: Fault("aer-fatal", m["total"], fatal=True)),
    (re.compile(r"AER non-fatal errors \d+ -> (?P<total>\d+)$"), lambda m: Fault("aer-nonfatal", m["total"])),
    (re.compile(r"driver unbound$"), lambda m: Fault("unbound")),
    (re.compile(r"bound to (?P<driver>\S+), not \S+$"), lambda m: Fault("unbound", m["driver"])),
    (re.compile(r"PCI function disabled"), lambda m: Fault("disabled")),
    (re.compile(r"PCIe link (?P<now>x?[\d.]+) of (?P<max>x?[\d.]+)"),
     lambda m: Fault("link", f"{m['now']}-of-{m['max']}")),
    (re.compile(r"probe timed out"), lambda m: Fault("probe-timeout")),
    (re.compile(r"\(the driver's own verdict\)$"), lambda m: Fault("driver-verdict")),
    (re.compile(r"^health state not trusted"), lambda m: Fault("unverified")),
    (re.compile(r": is c \d+:\d+, not c \d+:\d+$"), lambda m: Fault("node-mismatch")),
)


def faults_of(reasons: tuple[str, ...] | list[str]) -> list[Fault]:
    """The faults a verdict's reasons name, one per cause (the first reason of each), in their order; a reason
    no pattern knows is a `fault`. The reasons are the ones this module, `watch` and the channels' check
    write (tests/unit/test_health_faults.py holds each producer to its cause)."""
    out: dict[str, Fault] = {}
    for reason in reasons:
        fault = next((make(m) for pattern, make in _FAULTS if (m := pattern.search(reason))), Fault("fault"))
        out.setdefault(fault.cause, fault)
    return list(out.values())


def parse_kernel_log(text: str, patterns: tuple[str, ...]) -> dict[str, list[int]]:
    """Error codes per PCI slot (`0000:18:00`) from kernel log text, by the profiles' `health.kernel-log`
    patterns (each with `slot` and `code` groups)."""
    out: dict[str, list[int]] = {}
    for pattern in patterns:
        for match in re.finditer(pattern, text):
            out.setdefault(match.group("slot").lower(), []).append(int(match.group("code")))
    return out


def _aer_total(text: str | None, label: str) -> int:
    if not text:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == label and value.strip().isdigit():
            return int(value)
    return 0


def aer_totals(host: Host, pci: PciDevice) -> tuple[int, int]:
    """The function's AER totals: (fatal, non-fatal); 0 where the kernel shows none."""
    return (_aer_total(host.read_text(f"{pci.sys_path}/aer_dev_fatal"), "TOTAL_ERR_FATAL"),
            _aer_total(host.read_text(f"{pci.sys_path}/aer_dev_nonfatal"), "TOTAL_ERR_NONFATAL"))


def _speed(text: str | None) -> float | None:
    match = _SPEED.search(text or "")
    return float(match.group(1)) if match else None


def probe_function(host: Host, found: FoundDevice, xids: dict[str, list[int]],
                   baseline: AerBaseline | None) -> tuple[str, list[str], bool]:
    """Status, reasons and whether an unhealthy verdict is definite (the kernel's statement, not a reading) for
    one device (may block on a dead device's files: run it with a deadline)."""
    status, reasons, definite = HEALTHY, [], False

    def worse(level: str, reason: str, stated: bool = False) -> None:
        nonlocal status, definite
        reasons.append(reason)
        definite = definite or stated
        if _RANK[level] > _RANK[status]:
            status = level

    for pci in found.functions:
        path = pci.sys_path
        if not host.exists(f"/sys/bus/pci/devices/{pci.address}"):
            worse(UNHEALTHY, f"{pci.address}: gone from the PCI bus", stated=True)
            continue
        if host.readlink(f"{path}/driver") is None:
            worse(UNHEALTHY, f"{pci.address}: driver unbound", stated=True)
        if host.read_attr(f"{path}/enable") == "0":
            worse(UNHEALTHY, f"{pci.address}: PCI function disabled (enable=0)")
        width, max_width = host.read_attr(f"{path}/current_link_width"), host.read_attr(f"{path}/max_link_width")
        if width and max_width and width.isdigit() and max_width.isdigit() and int(width) < int(max_width):
            worse(DEGRADED, f"{pci.address}: PCIe link x{width} of x{max_width}")
        speed, max_speed = (_speed(host.read_attr(f"{path}/current_link_speed")),
                            _speed(host.read_attr(f"{path}/max_link_speed")))
        if speed and max_speed and speed < max_speed:
            worse(DEGRADED, f"{pci.address}: PCIe link {speed:g} of {max_speed:g} GT/s")
        fatal, nonfatal = aer_totals(host, pci)
        seen = (baseline.counts.get(pci.address, (fatal, nonfatal)) if baseline is not None else (0, 0))
        if fatal > seen[0]:
            worse(UNHEALTHY, f"{pci.address}: AER fatal errors {seen[0]} -> {fatal}")
        if nonfatal > seen[1]:
            worse(DEGRADED, f"{pci.address}: AER non-fatal errors {seen[1]} -> {nonfatal}")
        if baseline is not None:
            baseline.counts.setdefault(pci.address, (fatal, nonfatal))
        errors = found.profile.kernel_log
        if errors is not None:
            for code in xids.get(pci.address.rpartition(".")[0], []):
                if code in errors.fatal:
                    worse(UNHEALTHY, f"{pci.address}: fatal {errors.name} {code}", stated=True)
    for flag in found.profile.health_flags:  # the driver's own verdict, where it gives one
        info = parse_key_values(host.read_text(flag.file.format(address=found.address)) or "")
        if info.get(flag.key, "").lower() == flag.unhealthy.lower():
            worse(UNHEALTHY, f"{found.address}: {flag.key}: {info[flag.key]} (the driver's own verdict)")
    return status, list(dict.fromkeys(reasons)), definite and status == UNHEALTHY


class HealthChecker:
    """Checks devices with a deadline each; a device whose last probe still hangs is not probed again."""

    def __init__(self, host: Host, *, kernel_log: str = DEFAULT_KERNEL_LOG, timeout: float = PROBE_TIMEOUT,
                 baseline: AerBaseline | None = None) -> None:
        self.host = host
        self.kernel_log = kernel_log
        self.timeout = timeout
        self.baseline = baseline
        self._hung: dict[str, threading.Event] = {}
        self.log: KernelMessages = open_source(host, kernel_log)
        self._recent: dict[str, list[int]] = {}
        self.put_backs: dict[str, PutBack] = {}  # one-shot: errors logged before a device's put-back do not count

    def log_position(self) -> tuple[str | None, int | None]:
        """(file identity, offset) of the kernel log read so far, to resume from after a restart."""
        return self.log.position()

    def recent_errors(self) -> dict[str, list[int]]:
        """The fatal-candidate error codes read from the kernel log so far, per PCI slot."""
        return {slot: list(codes) for slot, codes in self._recent.items()}

    def resume(self, identity: str | None, offset: int | None, errors: dict[str, list[int]]) -> None:
        """Continue where an earlier agent stopped: from `offset` of the log file `identity` (from the start of
        another file: the log was rotated meanwhile; `offset` 0 and no identity: read the whole log), with the
        errors it had read."""
        self.log.resume(identity, offset)
        self._recent = {slot: list(codes) for slot, codes in errors.items()}

    @staticmethod
    def _patterns(devices: list[FoundDevice]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.profile.kernel_log.pattern for f in devices if f.profile.kernel_log))

    def read_log(self, devices: list[FoundDevice]) -> set[str]:
        """Watch (with a baseline): read what the kernel logged since the last read; the PCI slots it names
        with an error code (kept, sticky, for the checks that follow)."""
        patterns = self._patterns(devices)
        if not patterns or self.baseline is None:
            return set()
        try:
            new = self.log.read()
        except OSError:
            return set()
        found = parse_kernel_log(new.decode(errors="replace"), patterns)
        for slot, ids in found.items():
            self._recent.setdefault(slot, []).extend(ids)
        return set(found)

    def _xids(self, devices: list[FoundDevice], patterns: tuple[str, ...]) -> dict[str, dict[str, list[int]]]:
        """One-shot: every error the profiles' patterns find in the kernel's messages, per device key and
        slot; a device put back (`put_backs`) counts only what was logged after its put-back."""
        try:
            messages = self.log.messages()
        except OSError:
            return {}
        everything = parse_kernel_log("\n".join(m.text.decode(errors="replace") for m in messages), patterns)
        out: dict[str, dict[str, list[int]]] = {}
        for found in devices:
            key = device_key(found.profile.kind, found.address)
            put_back = self.put_backs.get(key)
            if put_back is None:
                out[key] = everything
                continue
            after = [m for m in messages if self.log.logged_after(m, put_back.log_identity, put_back.log_offset)]
            out[key] = parse_kernel_log("\n".join(m.text.decode(errors="replace") for m in after), patterns)
        return out

    def check(self, devices: list[FoundDevice], *, read_log: bool = True) -> list[Verdict]:
        """Verdicts for `devices`; the kernel log is read first unless the caller just did (`read_log`)."""
        if self.baseline is None:
            patterns = self._patterns(devices)
            per_device = self._xids(devices, patterns) if patterns else {}
            return [self._check_one(found, per_device.get(device_key(found.profile.kind, found.address), {}))
                    for found in devices]
        if read_log:
            self.read_log(devices)
        return [self._check_one(found, self._recent) for found in devices]

    def clear_xids(self, address: str) -> None:
        """Forget Xids for a device (after it was reset and came back)."""
        self._recent.pop(address.rpartition(".")[0], None)

    def _check_one(self, found: FoundDevice, xids: dict[str, list[int]]) -> Verdict:
        key = device_key(found.profile.kind, found.address)
        nodes = tuple(node_id_of(n) for n in found.nodes)
        pending = self._hung.get(key)
        if pending is not None and not pending.is_set():
            return Verdict(key, found.profile.kind, found.address, UNHEALTHY, ("probe timed out",), nodes)
        finished = threading.Event()

        put_back = self.put_backs.get(key) if self.baseline is None else None
        baseline = AerBaseline(dict(put_back.aer)) if put_back is not None else self.baseline

        def probe() -> tuple[str, list[str], bool]:
            try:
                return probe_function(self.host, found, xids, baseline)
            finally:
                finished.set()

        try:
            status, reasons, definite = call_with_timeout(probe, self.timeout)
        except ProbeTimeout:
            self._hung[key] = finished
            return Verdict(key, found.profile.kind, found.address, UNHEALTHY,
                           (f"probe timed out after {self.timeout:g}s",), nodes)
        return Verdict(key, found.profile.kind, found.address, status, tuple(reasons), nodes, definite)


def unbound_functions(host: Host, profiles: list[Profile]) -> list[tuple[Profile, PciDevice]]:
    """PCI functions of a known family that no profile claims as they are: driver unbound (or foreign)."""
    out = []
    for pci in scan_pci(host):
        if select_profile(profiles, pci) is not None:
            continue
        family = family_of(profiles, pci)  # a driver-only profile (vfio-pci) claims nothing it is not bound to
        if family is not None:
            out.append((family, pci))
    return out


def unbound_verdict(profile: Profile, pci: PciDevice) -> Verdict:
    reason = f"{pci.address}: driver unbound" if pci.driver is None else (
        f"{pci.address}: bound to {pci.driver}, not {'/'.join(profile.drivers)}")
    return Verdict(device_key(profile.kind, pci.address), profile.kind, pci.address, UNHEALTHY, (reason,),
                   definite=True)


def check_host(node: Node, *, timeout: float = PROBE_TIMEOUT, put_backs: dict[str, PutBack] | None = None,
               devices: list[FoundDevice] | None = None) -> list[Verdict]:
    """One-shot verdicts for every device of the node's profiles, bound or not: the devices the node
    discovered (no discovery of its own; `devices`: only those), its kernel messages (`--kernel-log`, else
    auto). `put_backs`: per device key, an admin's put-back — the AER totals it accepted are the baseline
    and only errors logged after it count."""
    checker = HealthChecker(node.host, kernel_log=node.kernel_log or AUTO, timeout=timeout)
    checker.put_backs = dict(put_backs or {})
    verdicts = checker.check(node.devices() if devices is None else devices)
    verdicts += [unbound_verdict(profile, pci) for profile, pci in unbound_functions(node.host, node.profiles)]
    return sorted(verdicts, key=lambda v: (v.kind, v.address))
