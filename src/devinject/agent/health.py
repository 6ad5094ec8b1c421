"""Device health: `healthy`, `degraded` or `unhealthy`, each with reasons, from what the kernel shows.

Sources (all under the host root): the PCI function's presence, driver binding, `enable`, PCIe link
width/speed against the maximum, AER counters, the driver's own flags and the fatal errors it logs in the kernel
log. Every probe runs with a deadline: a read that hangs (a driver file of a dead device) becomes
`unhealthy: probe timed out`.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field

from devinject.core.identity import device_key, node_id_of
from devinject.discovery.discover import FoundDevice, discover, family_of
from devinject.discovery.gpuinfo import ProbeTimeout, call_with_timeout
from devinject.discovery.host import Host
from devinject.discovery.procfs import parse_key_values
from devinject.discovery.profiles import Profile, select_profile
from devinject.discovery.sysfs import PciDevice, scan_pci

HEALTHY, DEGRADED, UNHEALTHY = "healthy", "degraded", "unhealthy"
_RANK = {HEALTHY: 0, DEGRADED: 1, UNHEALTHY: 2}
PROBE_TIMEOUT = 2.0
DEFAULT_KERNEL_LOG = "/var/log/kern.log"
_SPEED = re.compile(r"([\d.]+)\s*GT/s")


@dataclass(frozen=True, slots=True)
class Verdict:
    key: str  # kind=pci-address: stable across renames and index shifts
    kind: str
    address: str
    status: str
    reasons: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()  # "c 195:2": what the ledger refuses while unhealthy

    @property
    def healthy(self) -> bool:
        return self.status == HEALTHY


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
                   baseline: AerBaseline | None) -> tuple[str, list[str]]:
    """Status and reasons for one device (may block on a dead device's files: run it with a deadline)."""
    status, reasons = HEALTHY, []

    def worse(level: str, reason: str) -> None:
        nonlocal status
        reasons.append(reason)
        if _RANK[level] > _RANK[status]:
            status = level

    for pci in found.functions:
        path = pci.sys_path
        if not host.exists(f"/sys/bus/pci/devices/{pci.address}"):
            worse(UNHEALTHY, f"{pci.address}: gone from the PCI bus")
            continue
        if host.readlink(f"{path}/driver") is None:
            worse(UNHEALTHY, f"{pci.address}: driver unbound")
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
                    worse(UNHEALTHY, f"{pci.address}: fatal {errors.name} {code}")
    for flag in found.profile.health_flags:  # the driver's own verdict, where it gives one
        info = parse_key_values(host.read_text(flag.file.format(address=found.address)) or "")
        if info.get(flag.key, "").lower() == flag.unhealthy.lower():
            worse(UNHEALTHY, f"{found.address}: {flag.key}: {info[flag.key]} (the driver's own verdict)")
    return status, list(dict.fromkeys(reasons))


class HealthChecker:
    """Checks devices with a deadline each; a device whose last probe still hangs is not probed again."""

    def __init__(self, host: Host, *, kernel_log: str = DEFAULT_KERNEL_LOG, timeout: float = PROBE_TIMEOUT,
                 baseline: AerBaseline | None = None) -> None:
        self.host = host
        self.kernel_log = kernel_log
        self.timeout = timeout
        self.baseline = baseline
        self._hung: dict[str, threading.Event] = {}
        self._log_offset: int | None = None
        self._log_identity: str | None = None  # "dev:inode" of the log file the offset is in
        self._recent: dict[str, list[int]] = {}

    def log_position(self) -> tuple[str | None, int | None]:
        """(file identity, offset) of the kernel log read so far, to resume from after a restart."""
        return self._log_identity, self._log_offset

    def recent_errors(self) -> dict[str, list[int]]:
        """The fatal-candidate error codes read from the kernel log so far, per PCI slot."""
        return {slot: list(codes) for slot, codes in self._recent.items()}

    def resume(self, identity: str | None, offset: int | None, errors: dict[str, list[int]]) -> None:
        """Continue where an earlier agent stopped: from `offset` of the log file `identity` (from the start of
        another file: the log was rotated meanwhile; `offset` 0 and no identity: read the whole log), with the
        errors it had read."""
        self._log_identity, self._log_offset = identity, offset
        self._recent = {slot: list(codes) for slot, codes in errors.items()}

    def _xids(self, patterns: tuple[str, ...]) -> dict[str, list[int]]:
        """One-shot: every error the profiles' patterns find in the kernel log. Watch (with a baseline): only
        those logged since it started (or since the position it resumed from)."""
        path = self.host.real(self.host.resolve(self.kernel_log))
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, 2)
                if self.baseline is None:
                    handle.seek(0)
                    return parse_kernel_log(handle.read().decode(errors="replace"), patterns)
                st = os.fstat(handle.fileno())
                identity = f"{st.st_dev}:{st.st_ino}"
                if self._log_offset is None:  # first look: what is logged from now on
                    self._log_offset = size
                elif size < self._log_offset or self._log_identity not in (None, identity):  # rotated
                    self._log_offset = 0
                self._log_identity = identity
                handle.seek(self._log_offset)
                new = handle.read(size - self._log_offset)
                self._log_offset = size
        except OSError:
            return self._recent
        for slot, ids in parse_kernel_log(new.decode(errors="replace"), patterns).items():
            self._recent.setdefault(slot, []).extend(ids)
        return self._recent

    def check(self, devices: list[FoundDevice]) -> list[Verdict]:
        patterns = tuple(dict.fromkeys(f.profile.kernel_log.pattern for f in devices if f.profile.kernel_log))
        xids = self._xids(patterns) if patterns else {}
        return [self._check_one(found, xids) for found in devices]

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

        def probe() -> tuple[str, list[str]]:
            try:
                return probe_function(self.host, found, xids, self.baseline)
            finally:
                finished.set()

        try:
            status, reasons = call_with_timeout(probe, self.timeout)
        except ProbeTimeout:
            self._hung[key] = finished
            return Verdict(key, found.profile.kind, found.address, UNHEALTHY,
                           (f"probe timed out after {self.timeout:g}s",), nodes)
        return Verdict(key, found.profile.kind, found.address, status, tuple(reasons), nodes)


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
    return Verdict(device_key(profile.kind, pci.address), profile.kind, pci.address, UNHEALTHY, (reason,))


def check_host(host: Host, profiles: list[Profile], *, kernel_log: str = DEFAULT_KERNEL_LOG,
               timeout: float = PROBE_TIMEOUT) -> list[Verdict]:
    """One-shot verdicts for every device of every profile, bound or not."""
    checker = HealthChecker(host, kernel_log=kernel_log, timeout=timeout)
    verdicts = checker.check(discover(host, profiles))
    verdicts += [unbound_verdict(profile, pci) for profile, pci in unbound_functions(host, profiles)]
    return sorted(verdicts, key=lambda v: (v.kind, v.address))
