"""What `devinject list`, `health` and `who` show: result records over a Node, each with its JSON form in the
one vocabulary of docs/json.md (`name`, `kind`, `pci_address`, `numa_node`, `health`, `reasons`, `holders`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from devinject.agent.health import PROBE_TIMEOUT, Verdict, check_host
from devinject.core.identity import device_key, node_id_of
from devinject.discovery.node import Node
from devinject.discovery.topology import known_numa
from devinject.nodestate.ledger import Ledger, holders_of


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
    pci_address: str
    health: str  # healthy, degraded, unhealthy
    reasons: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.health == "healthy"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "pci_address": self.pci_address, "health": self.health,
                "reasons": list(self.reasons)}


@dataclass(frozen=True, slots=True)
class HeldNode:
    """A process holding one of a device's nodes open (`who`)."""

    name: str
    kind: str
    pci_address: str
    holder: Holder

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "pci_address": self.pci_address, **self.holder.to_json()}


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One discovered device as `list` shows it."""

    names: tuple[str, ...]  # its CDI names, index name first
    kind: str
    pci_address: str
    functions: tuple[str, ...]
    vendor: str
    model: str
    pci_id: str
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
        }


def _allocations(state_dir: str | None) -> dict[str, dict[str, Any]]:
    if not state_dir or not os.path.exists(os.path.join(state_dir, "ledger.json")):
        return {}
    allocations: dict[str, dict[str, Any]] = Ledger(state_dir).snapshot()["allocations"]
    return allocations


def verdicts(node: Node, *, timeout: float = PROBE_TIMEOUT) -> list[Verdict]:
    """Every device's verdict, bound or not, sorted by kind and address (agent/health.py's check_host)."""
    return check_host(node, timeout=timeout)


def device_health(node: Node, *, timeout: float = PROBE_TIMEOUT) -> list[DeviceHealth]:
    return [DeviceHealth(node.name_of(v.kind, v.address), v.kind, v.address, v.status, v.reasons)
            for v in verdicts(node, timeout=timeout)]


def inventory(node: Node, *, timeout: float = PROBE_TIMEOUT) -> list[DeviceRecord]:
    """Every discovered device with its health, the containers the ledger booked it for and its GPU-NIC pairs."""
    by_key = {v.key: v for v in verdicts(node, timeout=timeout)}
    allocations = _allocations(node.state_dir)
    paired = _pairs(node)
    rows = []
    for item in node.devices():
        pci = item.pci
        vendor = item.profile.vendor_name or f"{pci.vendor:04x}"
        nodes = {node_id_of(n) for n in item.nodes}
        verdict = by_key[device_key(item.profile.kind, item.address)]
        held_by = sorted(cid for cid, entry in allocations.items()
                         if nodes & set(entry.get("exclusive", []) + entry.get("shared", [])))
        holders = tuple(Holder(allocations[cid].get("pid"), cid, state=allocations[cid].get("state", "active"))
                        for cid in held_by)
        states = {h.state for h in holders}
        rows.append(DeviceRecord(
            names=tuple(node.names(item)), kind=item.profile.kind, pci_address=item.address,
            functions=tuple(f.address for f in item.functions), vendor=vendor,
            model=item.model or f"{vendor} {pci.device:04x}", pci_id=f"{pci.vendor:04x}:{pci.device:04x}",
            uuid=item.uuid, numa_node=known_numa(pci.numa_node), driver=pci.driver, sharing=item.profile.sharing,
            health=verdict.status, reasons=verdict.reasons, holders=holders,
            allocation="reclaiming" if "reclaiming" in states else ("allocated" if holders else "free"),
            nodes=tuple((n.path, n.major, n.minor) for n in item.nodes),
            paired_with=tuple(paired.get(device_key(item.profile.kind, item.address), ())),
        ))
    return rows


def _pairs(node: Node) -> dict[str, list[tuple[str, str]]]:
    """device key -> the devices it is paired with for `--bundles gpu-nic` (a GPU: its NIC; a NIC: its GPUs),
    each as (CDI name, relation)."""
    topo = node.topology()
    paired: dict[str, list[tuple[str, str]]] = {}
    for pair in topo.pairs():
        for one, other in ((pair.gpu, pair.nic), (pair.nic, pair.gpu)):
            device = topo.devices[one]
            paired.setdefault(device_key(device.profile.kind, device.address), []).append(
                (topo.name(other), pair.relation))
    return paired


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def holders(node: Node, device: str | None = None) -> list[HeldNode]:
    """Processes with a node of the devices (`device`: those it names, as Node.find reads it) open, and the
    container the ledger says they belong to."""
    owner: dict[str, tuple[str, str, str]] = {}
    for item in node.find(device) if device else node.devices():
        for device_node in item.nodes:
            owner.setdefault(node_id_of(device_node), (node.names(item)[0], item.profile.kind, item.address))
    allocations = _allocations(node.state_dir)
    rows = []
    for held, pids in sorted(holders_of(set(owner)).items()):
        container = next((cid for cid, entry in allocations.items() if held in entry.get("exclusive", [])
                          + entry.get("shared", [])), None)
        name, kind, address = owner[held]
        rows += [HeldNode(name, kind, address, Holder(pid, container, _command(pid), held)) for pid in sorted(pids)]
    return rows
