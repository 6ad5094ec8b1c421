"""The device plugin's side of the node's one ledger, shared with the DRA driver (docs/lifecycle.md, "Both
paths on one node").

The kubelet counts the device plugin's devices and the scheduler counts the DRA driver's slices, each
without the other: on one node both would hand one GPU to two pods. So the plugin books in the ledger what
`Allocate` hands out (`device-plugin:<resource>:<device ID>`, held for the node) and is refused what a
claim holds; the DRA driver is refused what the plugin holds. The booking learns its pod from the kubelet's
checkpoint (`kubelet_internal_checkpoint` in the plugin directory, written right after `Allocate` answers:
the request itself names no pod) and ends as nodestate/pluginrelease.py says (its pod's directory gone, or no
pod took it within the grace), a rule the DRA driver applies too. The checkpoint is also what a lost booking
is booked again from: every entry of a served resource whose pod still has its directory.

A device a claim holds is offered `Unhealthy` in ListAndWatch, so the kubelet's allocatable (and the
scheduler's count) drops by it and the kubelet never picks it; released, it is healthy again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from devinject.cdi.identity import path_identity
from devinject.core import jsonlite
from devinject.core.errors import LedgerError
from devinject.deviceplugin.allocation import AllocationError, PluginDevice
from devinject.nodestate.clashrule import clashes
from devinject.nodestate.ledger import (
    LEDGER_FILE,
    Claim,
    ForeignLedgerError,
    Ledger,
    held_nodes,
    is_claim,
    plugin_booking_id,
)
from devinject.nodestate.ledgerrecords import LedgerEntry
from devinject.nodestate.pluginrelease import UNKNOWN_POD_GRACE, plugin_verdicts, pods_present

log = logging.getLogger(__name__)

KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"
MAX_CHECKPOINT = 16 << 20  # bytes read of the kubelet's checkpoint at most


def checkpoint_devices(text: str) -> dict[tuple[str, str], set[str]]:
    """(resource, device ID) -> the pod UIDs the kubelet's device-manager checkpoint gives it to, from both
    of its forms (`DeviceIDs` per NUMA node, or a plain list before 1.20). Raises ValueError when it is not
    one."""
    data = jsonlite.loads(text)
    entries = data.get("Data", {}).get("PodDeviceEntries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("not a kubelet device-manager checkpoint (Data.PodDeviceEntries)")
    found: dict[tuple[str, str], set[str]] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        pod, resource, ids = entry.get("PodUID"), entry.get("ResourceName"), entry.get("DeviceIDs")
        if not isinstance(pod, str) or not isinstance(resource, str):
            continue
        if isinstance(ids, dict):
            ids = [i for per_numa in ids.values() if isinstance(per_numa, list) for i in per_numa]
        for device_id in ids if isinstance(ids, list) else ():
            if isinstance(device_id, str):
                found.setdefault((resource, device_id), set()).add(pod)
    return found


def read_checkpoint(path: str) -> dict[tuple[str, str], set[str]] | None:
    """The kubelet's checkpoint, or None when it is missing or cannot be read as one (nothing learned)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CHECKPOINT + 1)
    except OSError:
        return None
    if len(raw) > MAX_CHECKPOINT:
        return None
    try:
        return checkpoint_devices(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None


def in_initial_pid_namespace(proc: str = "/proc") -> bool:
    """Whether this process is in the node's initial pid namespace: its `NSpid:` lists one pid (one per
    namespace it is nested in otherwise)."""
    try:
        with open(f"{proc}/self/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return len(line.split()) == 2
    except OSError:
        pass
    return False


def device_claim(device: PluginDevice) -> Claim:
    return Claim(device.cdi_name, device.nodes, device.shared)  # type: ignore[arg-type]


def held_by_claims(allocations: Mapping[str, LedgerEntry], devices: dict[str, PluginDevice]) -> dict[str, str]:
    """Device ID -> why it is not offered: a DRA claim (among the ledger's `allocations`) holds one of its
    nodes."""
    claims = {cid: e for cid, e in allocations.items() if is_claim(e)}
    if not claims:
        return {}
    held: dict[str, str] = {}
    everything = held_nodes(claims, is_claim)
    for device_id, device in devices.items():
        exclusive = set(device.nodes) - set(device.shared)
        if not clashes(exclusive, device.shared, everything):
            continue
        for cid, entry in claims.items():
            one = (set(entry.exclusive), set(entry.shared))
            if clashes(exclusive, device.shared, one):
                held[device_id] = f"held by DRA claim {cid}"
                break
    return held


class PluginBookings:
    """The plugin's bookings on one node: booked in Allocate, their pods learned and released every round."""

    def __init__(self, state_dir: str, plugin_dir: str, pods_dir: str, *, proc: str = "/proc",
                 grace: float = UNKNOWN_POD_GRACE) -> None:
        self.ledger = Ledger(state_dir, proc=proc)
        self.checkpoint_path = os.path.join(plugin_dir, KUBELET_CHECKPOINT)
        self.pods_dir = pods_dir
        self.grace = grace
        self.said: set[str] = set()
        self.seen: tuple[object, ...] | None = None
        self.last_full = 0.0

    def can_book(self) -> bool:
        """Whether this process may write the node's ledger: it is in the pid namespace the ledger counts.
        An existing ledger says so itself (ForeignLedgerError); a missing one is made only from the node's
        initial pid namespace, never stamped with a pod's (every hook on the node would be refused then)."""
        if os.path.exists(os.path.join(self.ledger.state_dir, LEDGER_FILE)):
            return True
        if in_initial_pid_namespace(self.ledger.proc):
            return True
        self._say("pid-namespace", "not in the node's pid namespace (a pod without hostPID): what Allocate hands "
                  "out is not booked in the ledger until the hook or the DRA driver has made it")
        return False

    def book(self, resource: str, devices: list[PluginDevice]) -> None:
        """Allocate's booking, all devices or none: AllocationError names the holder of a refused one. In a
        pid namespace the ledger does not count, nothing is booked (said once): the allocation goes ahead
        as it did before the plugin booked anything."""
        if not self.can_book():
            return
        try:
            self.ledger.book_plugin(resource, {d.id: device_claim(d) for d in devices})
        except ForeignLedgerError as err:
            self._say("foreign", "what Allocate hands out is not booked: %s", err.message)
        except LedgerError as err:
            raise AllocationError(err.message) from None

    def read(self) -> dict[str, LedgerEntry] | None:
        """The ledger's bookings (Ledger.read)."""
        return self.ledger.read()

    def beside_dra(self) -> bool:
        """A DRA driver serves this node from the same state dir (its checkpoint is there)."""
        try:
            from devinject.nodestate.claimcheckpoints import PREFIX, SUFFIX

            return any(n.startswith(PREFIX) and n.endswith(SUFFIX) for n in os.listdir(self.ledger.state_dir))
        except OSError:
            return False

    def _signature(self) -> tuple[object, ...]:
        """What a round reads, by identity: nothing changed, nothing to do (but the grace's expiry)."""
        return tuple(path_identity(path) for path in
                     (os.path.join(self.ledger.state_dir, LEDGER_FILE), self.checkpoint_path, self.pods_dir))

    def due(self, now: float) -> bool:
        signature = self._signature()
        if signature == self.seen and now - self.last_full < max(1.0, self.grace / 4):
            return False
        self.seen, self.last_full = signature, now
        return True

    def reconcile(self, served: dict[str, dict[str, PluginDevice]]) -> None:
        """Learn the pods of the plugin's bookings, release those whose pods are gone, book again what the
        kubelet's checkpoint gives a pod that exists and the ledger lacks (a restart, a rebuilt ledger).
        `served`: resource -> its devices now."""
        allocations = self.ledger.read() or {}
        given = read_checkpoint(self.checkpoint_path)
        present = pods_present(self.pods_dir)
        if present is None:
            self._say("pods", "%s: cannot read the kubelet's pod directories: the device plugin's bookings end "
                      "only when the kubelet's checkpoint forgets them", self.pods_dir)
        learned, released = plugin_verdicts(allocations, given, present, time.time(), self.grace)
        if learned or released:
            try:
                self.ledger.plugin_update(learned, released)
            except LedgerError as err:
                self._say("update", "device plugin bookings: %s", err.message)
                return
            for booking_id in released:
                log.info("%s released: its pod is gone", booking_id)
        if given is None or not self.can_book():
            return
        for (resource, device_id), pods in sorted(given.items()):
            devices = served.get(resource)
            alive = pods & present if present is not None else pods
            booking_id = plugin_booking_id(resource, device_id)
            if devices is None or device_id not in devices or not alive or booking_id in allocations:
                continue
            try:
                if self.ledger.book_plugin(resource, {device_id: device_claim(devices[device_id])},
                                           pods={device_id: sorted(alive)}):
                    log.info("%s booked again for pod %s (the kubelet's checkpoint)", booking_id,
                             ", ".join(sorted(alive)))
            except ForeignLedgerError as err:
                self._say("foreign", "what Allocate hands out is not booked: %s", err.message)
                return
            except LedgerError as err:
                self._say(booking_id, "%s: the kubelet gave it to pod %s, but it cannot be booked: %s", booking_id,
                          ", ".join(sorted(alive)), err.message, level=logging.ERROR)

    def _say(self, key: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        if key not in self.said:
            self.said.add(key)
            log.log(level, message, *args)

