"""What `devinject list`, `health` and `who` show, computed over a Node: verdicts, the ledger's holders, the
processes holding nodes open. The records they answer with are results.py's."""

from __future__ import annotations

from devinject.agent.channels import channel_verdicts
from devinject.agent.health import DEGRADED, HEALTHY, PROBE_TIMEOUT, UNHEALTHY, Verdict, check_host
from devinject.agent.healthstate import Published, load_published, load_put_backs
from devinject.agent.mps import MpsDaemons
from devinject.cdi.identity import NodeId, device_key, node_id_of
from devinject.discovery.channels import ChannelDevice
from devinject.discovery.node import Node
from devinject.discovery.topology import known_numa
from devinject.nodestate.ledger import Ledger, LedgerEntry, holders_of
from devinject.nodestate.profilefacts import time_slicing
from devinject.results import DeviceHealth, DeviceRecord, HeldNode, Holder


def _allocations(state_dir: str | None) -> dict[str, LedgerEntry]:
    return Ledger(state_dir).entries() if state_dir else {}


def verdicts(node: Node, *, timeout: float = PROBE_TIMEOUT) -> list[Verdict]:
    """Every device's verdict, bound or not, sorted by kind and address (agent/health.py's check_host), then
    the channels' by kind and number (agent/channels.py): the one the agents act on.

    Where an agent (`watch`, `device-plugin`) published verdicts (the state dir's health.json, which the
    ledger and the DRA driver act on), a device it judged has its published verdict (`published_verdict`),
    put-backs included; a device no agent judged (no agent ran, or it serves other kinds) is checked here
    and now, honouring the put-backs recorded in the state dir (an error logged before one does not count,
    the AER totals it accepted are the baseline). A health.json or put-back record that cannot be read is
    an error naming it (DevinjectError), never a guess."""
    published = load_published(node.state_dir) or {}
    put_backs = load_put_backs(node.state_dir)
    fresh = [f for f in node.devices() if device_key(f.profile.kind, f.address) not in published]
    judged = check_host(node, timeout=timeout, put_backs=put_backs, devices=fresh)
    judged = [v for v in judged if v.key not in published]  # an unbound function the agent judged too
    channels = [v for v in channel_verdicts(node.host, node.channels()) if v.key not in published]
    agents = [published_verdict(node, key, entry) for key, entry in published.items()]
    present: set[str] = {device_key(f.profile.kind, f.address) for f in node.devices()}
    present |= {c.key for c in node.channels()}
    present |= {v.key for v in judged}
    agents = [v for v in agents if v.key in present or v.status != HEALTHY]
    order: dict[str, int] = {c.key: i for i, c in enumerate(node.channels())}
    rows = judged + agents + channels
    return sorted((v for v in rows if v.key not in order), key=lambda v: (v.kind, v.address)) + sorted(
        (v for v in rows if v.key in order), key=lambda v: order[v.key])


def published_verdict(node: Node, key: str, entry: Published) -> Verdict:
    """A device as an agent published it: unhealthy while it is out (the specs, the kubelet, the ledger and
    the DRA driver refuse it), with the reasons of its latest check (or why it is still out: a put-back
    waits for `--threshold` passing checks); served otherwise, `degraded` when its latest check found a
    reading the agent has not confirmed (or a degraded one)."""
    kind, _, address = key.partition("=")
    if entry.published == UNHEALTHY:
        reasons = entry.reasons if entry.status == UNHEALTHY else (
            *entry.reasons, "out of service until its checks pass (taken out by the node agent)")
        return Verdict(key, kind, address, UNHEALTHY, reasons, definite=True)
    if entry.status in (None, HEALTHY):
        return Verdict(key, kind, address, HEALTHY)
    reasons = entry.reasons if entry.status == DEGRADED else (
        *entry.reasons, "not yet confirmed: still served")
    return Verdict(key, kind, address, DEGRADED, reasons)


def device_health(node: Node, *, timeout: float = PROBE_TIMEOUT) -> list[DeviceHealth]:
    channels = {c.key for c in node.channels()}
    return [DeviceHealth(v.key, v.kind, None, v.status, v.reasons) if v.key in channels else
            DeviceHealth(node.name_of(v.kind, v.address), v.kind, v.address, v.status, v.reasons)
            for v in verdicts(node, timeout=timeout)]


def inventory(node: Node, *, timeout: float = PROBE_TIMEOUT) -> list[DeviceRecord]:
    """Every discovered device with its health, the containers the ledger booked it for and its GPU-NIC pairs."""
    by_key = {v.key: v for v in verdicts(node, timeout=timeout)}
    allocations = _allocations(node.state_dir)
    paired = _pairs(node)
    sliced = time_slicing(node.state_dir) if node.state_dir else {}
    mps = MpsDaemons(node.state_dir).running() if node.state_dir else {}
    rows = []
    for item in node.devices():
        pci = item.pci
        vendor = item.profile.vendor_name or f"{pci.vendor:04x}"
        verdict = by_key[device_key(item.profile.kind, item.address)]
        holders = _booked({node_id_of(n) for n in item.nodes}, allocations)
        gpu = node.gpu_facts(item)
        rows.append(DeviceRecord(
            names=tuple(node.names(item)), kind=item.profile.kind, pci_address=item.address,
            functions=tuple(f.address for f in item.functions), vendor=vendor,
            model=item.model or f"{vendor} {pci.device:04x}", pci_id=f"{pci.vendor:04x}:{pci.device:04x}",
            uuid=item.uuid, numa_node=known_numa(pci.numa_node), driver=pci.driver,
            sharing="mps" if item.address in mps else "time-slicing" if item.profile.kind in sliced
            else item.profile.sharing, replicas=sliced.get(item.profile.kind),
            health=verdict.status, reasons=verdict.reasons, holders=holders,
            allocation=_allocation(holders),
            nodes=tuple((n.path, n.major, n.minor) for n in item.nodes),
            paired_with=tuple(paired.get(device_key(item.profile.kind, item.address), ())),
            memory_bytes=node.memory_bytes(item), compute_capability=gpu.cuda_compute_capability if gpu else None,
        ))
    return rows + [_channel_record(c, by_key[c.key], _booked({node_id_of(c.node)}, allocations))
                   for c in node.channels()]


def _booked(nodes: set[NodeId], allocations: dict[str, LedgerEntry]) -> tuple[Holder, ...]:
    """The containers the ledger booked one of `nodes` for, by container id."""
    wanted: set[str] = set(nodes)
    return tuple(Holder(allocations[cid].pid, cid, state=allocations[cid].state)
                 for cid in sorted(cid for cid, entry in allocations.items() if entry.holds(wanted)))


def _allocation(holders: tuple[Holder, ...]) -> str:
    states = {h.state for h in holders}
    return "reclaiming" if "reclaiming" in states else ("allocated" if holders else "free")


def _channel_record(channel: ChannelDevice, verdict: Verdict, holders: tuple[Holder, ...]) -> DeviceRecord:
    """A channel as `list` shows it: its one CDI name and its node; no PCI function, so no address, PCI ID,
    NUMA node or driver binding; its model is the vendor and the kind's class (`NVIDIA imex-channel`)."""
    profile = channel.profile
    node = channel.node
    vendor = profile.vendor_name or profile.kind.partition("/")[0]
    return DeviceRecord(
        names=(channel.key,), kind=profile.kind, pci_address=None, functions=(),
        vendor=vendor, model=f"{vendor} {profile.kind.partition('/')[2]}", pci_id=None,
        uuid=None, numa_node=None, driver=None, sharing=profile.sharing, health=verdict.status,
        reasons=verdict.reasons, holders=holders, allocation=_allocation(holders),
        nodes=((node.path, node.major, node.minor),), paired_with=())


def _pairs(node: Node) -> dict[str, list[tuple[str, str]]]:
    """device key -> the devices it is paired with for `--bundles gpu-nic` (a GPU: its NIC; a NIC: its GPUs),
    each as (CDI name, relation)."""
    topo = node.topology()
    return {device_key(topo.devices[i].profile.kind, topo.devices[i].address): found
            for i, found in topo.paired_with().items()}


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def holders(node: Node, device: str | None = None) -> list[HeldNode]:
    """Processes with a node of the devices (`device`: those it names, discovery/resolve.py; UnknownDevice for
    a name no device answers to) open, and the container the ledger says they belong to."""
    from devinject.discovery.resolve import Named, resolve

    named = resolve(node, device) if device else Named(tuple(node.devices()), tuple(node.channels()))
    owner: dict[str, tuple[str, str, str | None]] = {}
    for item in named.devices:
        for device_node in item.nodes:
            owner.setdefault(node_id_of(device_node), (node.names(item)[0], item.profile.kind, item.address))
    for channel in named.channels:
        owner.setdefault(node_id_of(channel.node), (channel.key, channel.profile.kind, None))
    allocations = _allocations(node.state_dir)
    rows = []
    for held, pids in sorted(holders_of(set(owner)).items()):
        container = next((cid for cid, entry in allocations.items() if entry.holds({held})), None)
        name, kind, address = owner[held]
        rows += [HeldNode(name, kind, address, Holder(pid, container, _command(pid), held)) for pid in sorted(pids)]
    return rows
