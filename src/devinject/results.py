"""The records the library answers with (`devinject.api.LiveNode`'s `health()`, `inventory()`, `holders()`,
`events()`), in one module as psutil keeps its result types: each with its `to_json()`, the one vocabulary of
docs/json.md (`name`, `kind`, `pci_address`, `numa_node`, `health`, `reasons`, `holders`). A device that is a char
node and no PCI function (an IMEX channel: Node.channels) has `pci_address` null. inventory.py computes them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from devinject.cdi.identity import device_key


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a device: a container the ledger booked it for (its `state` active or reclaiming, the pid it
    booked with), or a process with one of its nodes open (`who`: its pid, command, the node)."""

    pid: int | None
    container: str | None
    command: str | None = None
    node: str | None = None  # "c 195:0"
    state: str | None = None  # the ledger's: active, reclaiming

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "container": self.container, "command": self.command, "node": self.node,
                "state": self.state}


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """One device's verdict (`health`)."""

    name: str
    kind: str
    pci_address: str | None  # None: a char-node device (an IMEX channel), whose key is its name
    health: str  # healthy, degraded, unhealthy
    reasons: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.health == "healthy"

    @property
    def key(self) -> str:
        """What health and watch track it by: `kind=PCI address`; a channel's name (`kind=N`)."""
        return self.name if self.pci_address is None else device_key(self.kind, self.pci_address)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "pci_address": self.pci_address, "health": self.health,
                "reasons": list(self.reasons)}


@dataclass(frozen=True, slots=True)
class HeldNode:
    """A process holding one of a device's nodes open (`who`)."""

    name: str
    kind: str
    pci_address: str | None  # None: a char-node device (an IMEX channel)
    holder: Holder

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "pci_address": self.pci_address, **self.holder.to_json()}


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One discovered device as `list` shows it."""

    names: tuple[str, ...]  # its CDI names, index name first
    kind: str
    pci_address: str | None  # None, like pci_id and numa_node, and no functions: a channel (no PCI function)
    functions: tuple[str, ...]
    vendor: str
    model: str
    pci_id: str | None
    uuid: str | None
    numa_node: int | None  # None: the kernel does not know (-1)
    driver: str | None
    sharing: str
    health: str
    reasons: tuple[str, ...]
    holders: tuple[Holder, ...]
    allocation: str  # free, allocated, reclaiming
    nodes: tuple[tuple[str, int | None, int | None], ...]  # path, major, minor
    paired_with: tuple[tuple[str, str], ...]  # (CDI name, relation) for --bundles gpu-nic
    replicas: int | None = None  # time-slicing: how many containers may share it
    memory_bytes: int | None = None  # NVML's total for an NVIDIA GPU, else what sysfs states (AMD's VRAM)
    compute_capability: str | None = None  # CUDA's, from NVML (`9.0`)

    @property
    def name(self) -> str:
        return self.names[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "names": list(self.names), "kind": self.kind, "pci_address": self.pci_address,
            "functions": list(self.functions), "vendor": self.vendor, "model": self.model, "pci_id": self.pci_id,
            "uuid": self.uuid, "numa_node": self.numa_node, "driver": self.driver, "sharing": self.sharing,
            "health": self.health, "reasons": list(self.reasons), "holders": [h.to_json() for h in self.holders],
            "allocation": self.allocation,
            "nodes": [{"path": path, "major": major, "minor": minor} for path, major, minor in self.nodes],
            "paired_with": [{"name": name, "relation": relation} for name, relation in self.paired_with],
            "replicas": self.replicas, "memory_bytes": self.memory_bytes,
            "compute_capability": self.compute_capability,
        }


_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# the fields of a recorded event that are the vocabulary's, under its names; the rest are the event's own
_RENAMED = {"status": "health"}
_OWN = ("time", "event", "device", "reasons")


@dataclass(frozen=True, slots=True)
class Event:
    """One transition of the state dir's per-device ring (nodestate/events.py): the device by its key
    (`kind=PCI address`, the name the pci naming strategy gives it; an IMEX channel's is its CDI name,
    `kind=N`), what happened, why."""

    name: str
    time: float
    event: str
    reasons: tuple[str, ...] = ()
    details: tuple[tuple[str, Any], ...] = ()  # what else the event recorded (health, by, functions, ...)

    @classmethod
    def of(cls, name: str, entry: dict[str, Any]) -> Event:
        details = tuple((_RENAMED.get(k, k), v) for k, v in sorted(entry.items()) if k not in _OWN)
        return cls(name, float(entry["time"]), str(entry["event"]), tuple(entry.get("reasons", ())), details)

    @property
    def kind(self) -> str:
        return self.name.partition("=")[0]

    @property
    def pci_address(self) -> str | None:
        """The key's PCI address; None for a device that is no PCI function (a channel: `kind=N`)."""
        address = self.name.partition("=")[2]
        return address if _PCI_ADDRESS.fullmatch(address) else None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "pci_address": self.pci_address, "time": self.time,
                "event": self.event, "reasons": list(self.reasons), **dict(self.details)}
