"""When a device-plugin booking ends: one rule for both agents, so that a device the kubelet no longer gives
any pod comes back to the node's offer whether or not the device plugin runs.

The device plugin books what `Allocate` hands out for the node (ledger.py, `device-plugin:<resource>:<ID>`)
and learns the booking's pod from the kubelet's checkpoint. The booking ends when that pod's directory under
the kubelet's `pods/` is gone (the kubelet removes it once the pod's containers have ended and its volumes
are torn down), or when no pod took the device within the grace (an admission that failed after
`Allocate`). The device plugin applies the rule every round; the DRA driver applies it too, so that
bookings left behind when the device plugin went first (its DaemonSet deleted before its pods: the usual
order of a move to DRA), or when the state dir outlived its cluster (rebuilt, purged), do not keep their
devices out of the driver's slices for good.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping

from devinject.cdi.identity import path_identity
from devinject.core.errors import LedgerError
from devinject.nodestate.clashrule import plugin_device_id
from devinject.nodestate.ledger import LEDGER_FILE, Ledger, is_plugin
from devinject.nodestate.ledgerrecords import LedgerEntry

log = logging.getLogger(__name__)

UNKNOWN_POD_GRACE = 30.0  # seconds a booking waits for the kubelet's checkpoint to name a pod that exists


def pods_present(pods_dir: str) -> set[str] | None:
    """The pod UIDs with a directory under the kubelet's `pods/`; None when that directory cannot be read."""
    try:
        return set(os.listdir(pods_dir))
    except OSError:
        return None


def plugin_verdicts(allocations: Mapping[str, LedgerEntry], given: dict[tuple[str, str], set[str]] | None,
                    present: set[str] | None, now: float,
                    grace: float = UNKNOWN_POD_GRACE) -> tuple[dict[str, list[str]], list[str]]:
    """For the device plugin's bookings among `allocations`: the pods each was given to that are still there
    (booking ID -> pod UIDs, where that changed), and the bookings that end. `given`: the kubelet's checkpoint
    ((resource, device ID) -> pod UIDs; None when it cannot be read); `present`: the pod UIDs with a
    directory (None when they cannot be listed)."""
    learned: dict[str, list[str]] = {}
    released: list[str] = []
    for booking_id, entry in allocations.items():
        if not is_plugin(entry):
            continue
        resource, device_id = str(entry.plugin), plugin_device_id(booking_id)
        named = given.get((resource, device_id), set()) if given is not None else set()
        alive = named & present if present is not None else named
        known = list(entry.pods or ())
        if alive:
            if sorted(alive) != known:
                learned[booking_id] = sorted(alive)
        elif known and present is not None and not set(known) & present:
            released.append(booking_id)  # its pod is gone
        elif known and present is None and given is not None and not named:
            released.append(booking_id)  # the kubelet forgot it
        elif not known and now - entry.time > grace:
            released.append(booking_id)  # no pod took it: the admission failed after Allocate
    return learned, released


class GonePodReleaser:
    """The rule applied without the kubelet's checkpoint (the DRA driver's view: the kubelet's pod
    directories and the ledger), at most every `every` seconds unless one of the two changed."""

    def __init__(self, state_dir: str, pods_dir: str, *, proc: str = "/proc", grace: float = UNKNOWN_POD_GRACE,
                 every: float = 10.0) -> None:
        self.ledger = Ledger(state_dir, proc=proc)
        self.pods_dir = pods_dir
        self.grace = grace
        self.every = every
        self.seen: tuple[object, ...] | None = None
        self.last = 0.0
        self.said = False

    def _signature(self) -> tuple[object, ...]:
        return tuple(path_identity(p) for p in (os.path.join(self.ledger.state_dir, LEDGER_FILE), self.pods_dir))

    def release(self, now: float | None = None) -> list[str]:
        """Release the device plugin's bookings whose pods the kubelet no longer has; their IDs. Without the
        pod directories nothing is released (said once): a booking's pod cannot be told gone then."""
        now = time.time() if now is None else now
        signature = self._signature()
        if signature == self.seen and now - self.last < self.every:
            return []
        self.seen, self.last = signature, now
        allocations = self.ledger.read() or {}
        if not any(is_plugin(entry) for entry in allocations.values()):
            return []
        present = pods_present(self.pods_dir)
        if present is None:
            if not self.said:
                self.said = True
                log.warning("%s: cannot read the kubelet's pod directories: the device plugin's bookings are "
                            "released only by the device plugin", self.pods_dir)
            return []
        _, released = plugin_verdicts(allocations, None, present, now, self.grace)
        return self._release(released)

    def _release(self, released: Iterable[str]) -> list[str]:
        released = list(released)
        if not released:
            return []
        try:
            self.ledger.plugin_update({}, released)
        except LedgerError as err:
            log.warning("device plugin bookings: %s", err.message)
            return []
        for booking_id in released:
            log.info("%s released: its pod is gone from the kubelet", booking_id)
        return released
