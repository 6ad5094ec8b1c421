"""The driver's entries of a prepared claim's `status.devices` (DRAResourceClaimDeviceStatus: beta and on in
1.36, GA in 1.37): for each of its devices in the claim a `Ready` condition, and for a network function (a
PCI function with a netdev: an RDMA NIC) its `networkData`, the interface name and hardware address sysfs
gives. Written by server-side apply with the driver's name as field manager, so its entries are its own and
another driver's stay; the apply of no entries at unprepare removes them. The writes go on a thread of their
own after the kubelet's call was answered: a prepare never waits on the API server for them, and a write
that fails is logged and given up (the claim is prepared either way; the status is for people and tools)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from devinject.core.errors import DevinjectError
from devinject.discovery.host import Host

log = logging.getLogger(__name__)

MAX_PENDING = 256  # writes queued at most; beyond, the oldest is the one that waits (put blocks no prepare)
MAX_INTERFACE = 256  # characters of an interface name and hardware address the API takes (validation)


@dataclass(frozen=True, slots=True)
class StatusDevice:
    """One of the driver's devices in a claim, as its status entry names it."""

    pool: str
    device: str
    share_id: str | None = None
    pci_address: str | None = None  # a PCI function's (its netdev, if any, is its network data)


def network_data(host: Host, pci_address: str) -> dict[str, str] | None:
    """The first netdev of a PCI function (sysfs `bus/pci/devices/<bdf>/net/<if>/address`): its interface
    name and hardware address; None when it has none (a GPU, or a NIC whose netdev is gone)."""
    net = host.real(f"/sys/bus/pci/devices/{pci_address}/net")
    try:
        names = sorted(os.listdir(net))
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(net, name, "address"), encoding="ascii", errors="replace") as handle:
                address = handle.read(MAX_INTERFACE).strip()
        except OSError:
            continue
        data = {"interfaceName": name[:MAX_INTERFACE]}
        if address:
            data["hardwareAddress"] = address
        return data
    return None


def device_entries(driver: str, devices: list[StatusDevice], host: Host, now: str,
                   generation: int | None = None) -> list[dict[str, Any]]:
    """The claim's `status.devices` entries of this driver: each device Ready (prepared on the node), a
    network function's interface too."""
    entries = []
    for device in devices:
        condition: dict[str, Any] = {"type": "Ready", "status": "True", "reason": "Prepared",
                                     "message": f"prepared by {driver} on the node", "lastTransitionTime": now}
        if generation is not None:
            condition["observedGeneration"] = generation
        entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device,
                                 "conditions": [condition]}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        net = network_data(host, device.pci_address) if device.pci_address else None
        if net is not None:
            entry["networkData"] = net
        entries.append(entry)
    return entries


def apply_body(namespace: str, name: str, uid: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The server-side apply of a claim's status with these entries (none: the driver's are removed); the
    claim's uid makes a claim deleted and made again under its name refuse it (a 409)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid}, "status": {"devices": entries}}


Apply = Callable[[str, str, dict[str, Any]], object]  # (namespace, name, body): the API server's apply


class StatusWriter:
    """The claims' status writes, in order, on one thread: `prepared` and `unprepared` queue them."""

    def __init__(self, driver: str, host: Callable[[], Host], apply: Apply) -> None:
        self.driver, self.host, self.apply = driver, host, apply
        self.pending: queue.Queue[tuple[str, str, str, list[StatusDevice]] | None] = queue.Queue(MAX_PENDING)
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def prepared(self, namespace: str, name: str, uid: str, devices: list[StatusDevice]) -> None:
        self._queue((namespace, name, uid, devices))

    def unprepared(self, namespace: str, name: str, uid: str) -> None:
        self._queue((namespace, name, uid, []))

    def _queue(self, item: tuple[str, str, str, list[StatusDevice]]) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="claim-status", daemon=True)
                self.thread.start()
        try:
            self.pending.put_nowait(item)
        except queue.Full:
            log.warning("claim %s/%s: its device status is not written: %d writes wait already", item[0], item[1],
                        MAX_PENDING)

    def _run(self) -> None:
        while True:
            item = self.pending.get()
            if item is None:
                return
            self.write(*item)

    def write(self, namespace: str, name: str, uid: str, devices: list[StatusDevice]) -> bool:
        """One claim's entries applied now (none: removed); False when the API server refused or was away
        (logged; a claim gone meanwhile is no error)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            entries = device_entries(self.driver, devices, self.host(), now) if devices else []
            self.apply(namespace, name, apply_body(namespace, name, uid, entries))
        except DevinjectError as err:
            status = getattr(err, "status", 0)
            if status not in (404, 409):  # deleted (or made again) meanwhile: nothing of ours to say there
                log.warning("claim %s/%s (%s): device status not %s: %s", namespace, name, uid,
                            "written" if devices else "removed", err.message)
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """The writes queued so far done (for at most `timeout` s), then the thread ends."""
        with self.lock:
            thread, self.thread = self.thread, None
        if thread is not None:
            self.pending.put(None)
            thread.join(timeout)
