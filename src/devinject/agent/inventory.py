"""What `devinject list` and `devinject who` show, as plain data."""

from __future__ import annotations

import os
from typing import Any

from devinject.agent.health import HealthChecker
from devinject.core.identity import device_key, node_id_of, qualified
from devinject.discovery.discover import FoundDevice, discover
from devinject.discovery.host import Host
from devinject.discovery.profiles import load_profiles
from devinject.nodestate.ledger import Ledger, holders_of
from devinject.specs.generate import device_names


def _allocations(state_dir: str) -> dict[str, dict[str, Any]]:
    if not os.path.exists(os.path.join(state_dir, "ledger.json")):
        return {}
    allocations: dict[str, dict[str, Any]] = Ledger(state_dir).snapshot()["allocations"]
    return allocations


def inventory(root: str, *, profile_dirs: tuple[str, ...] = (), state_dir: str | None = None,
              kernel_log: str = "/var/log/kern.log") -> list[dict[str, Any]]:
    host = Host(root)
    found = discover(host, load_profiles(host, profile_dirs))
    verdicts = {v.key: v for v in HealthChecker(host, kernel_log=kernel_log).check(found)}
    allocations = _allocations(state_dir) if state_dir else {}
    paired = _pairs(host, found)
    rows = []
    for item in found:
        pci = item.pci
        vendor = item.profile.vendor_name or f"{pci.vendor:04x}"
        nodes = [node_id_of(n) for n in item.nodes]
        verdict = verdicts[device_key(item.profile.kind, item.address)]
        held_by = sorted(cid for cid, entry in allocations.items()
                         if set(nodes) & set(entry.get("exclusive", []) + entry.get("shared", [])))
        states = {allocations[cid].get("state", "active") for cid in held_by}
        rows.append({
            "names": [qualified(item.profile.kind, n) for n in device_names(item, ())],
            "kind": item.profile.kind,
            "pci": item.address,
            "functions": [f.address for f in item.functions],
            "vendor": vendor,
            "model": item.model or f"{vendor} {pci.device:04x}",
            "pci_id": f"{pci.vendor:04x}:{pci.device:04x}",
            "uuid": item.uuid,
            "numa_node": pci.numa_node,
            "driver": pci.driver,
            "sharing": item.profile.sharing,
            "health": verdict.status,
            "health_reasons": list(verdict.reasons),
            "held_by": held_by,
            "state": "reclaiming" if "reclaiming" in states else ("allocated" if held_by else "free"),
            "nodes": [{"path": n.path, "major": n.major, "minor": n.minor} for n in item.nodes],
            "paired_with": paired.get(device_key(item.profile.kind, item.address), []),
        })
    return rows


def _pairs(host: Host, found: list[FoundDevice]) -> dict[str, list[str]]:
    """device key -> the devices it is paired with for `--bundles gpu-nic` (a GPU: its NIC; a NIC: its GPUs),
    each as `<kind>=<index> (<relation>)`."""
    from devinject.discovery.topology import topology

    topo = topology(host, found)
    paired: dict[str, list[str]] = {}
    for pair in topo.pairs():
        gpu, nic = topo.devices[pair.gpu], topo.devices[pair.nic]
        for one, other in ((gpu, nic), (nic, gpu)):
            paired.setdefault(device_key(one.profile.kind, one.address), []).append(
                f"{qualified(other.profile.kind, str(other.index))} ({pair.relation})")
    return paired


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def holders(root: str, *, state_dir: str, device: str | None = None) -> list[dict[str, Any]]:
    """Processes with a discovered device's node open, and the container the ledger says they belong to."""
    host = Host(root)
    nodes: dict[str, str] = {}
    for item in discover(host, load_profiles(host)):
        names = [qualified(item.profile.kind, n) for n in device_names(item, ())]
        if device and not any(device in (n, n.partition("=")[2]) for n in names) and device != item.address:
            continue
        for device_node in item.nodes:
            nodes.setdefault(node_id_of(device_node), names[0])
    allocations = _allocations(state_dir)
    rows = []
    for node, pids in sorted(holders_of(set(nodes)).items()):
        for pid in sorted(pids):
            container = next((cid for cid, entry in allocations.items() if node in entry.get("exclusive", [])
                              + entry.get("shared", [])), None)
            rows.append({"device": nodes[node], "node": node, "pid": pid, "command": _command(pid),
                         "container": container})
    return rows
