"""How close two devices are, from sysfs alone (any vendor, no vendor library): the relations admins know
from `nvidia-smi topo -m`, computed from each function's place in the PCIe tree and its NUMA node.

- `PIX`: the same PCIe switch (or functions of one slot): at most two hops below the deepest common bridge;
- `PXB`: several bridges, without the host bridge (nested switches under one root port);
- `PHB`: through one host bridge (different root ports of one root complex);
- `NODE`: different host bridges on the same NUMA node;
- `SYS`: across NUMA nodes. A device whose NUMA node the kernel does not know (`numa_node` -1) is never
  guessed closer: across host bridges it is `SYS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host

SELF, PIX, PXB, PHB, NODE, SYS = "X", "PIX", "PXB", "PHB", "NODE", "SYS"
RANK = {SELF: 0, PIX: 1, PXB: 2, PHB: 3, NODE: 4, SYS: 5}  # closer first
LEGEND = (
    "X    = self",
    "SYS  = across NUMA nodes (or a NUMA node the kernel does not report)",
    "NODE = different PCIe host bridges on one NUMA node",
    "PHB  = through one PCIe host bridge",
    "PXB  = several PCIe bridges, without a host bridge",
    "PIX  = one PCIe switch (or one slot)",
)


@dataclass(frozen=True, slots=True)
class Place:
    """Where a device sits: its PCIe path from the host bridge (`pci0000:12`, root port, ..., itself)."""

    address: str
    path: tuple[str, ...]
    numa: int | None  # None: the kernel does not know (-1)
    cpus: str  # local_cpulist, as the kernel prints it ("" when absent)


def known_numa(numa_node: int) -> int | None:
    """The kernel's `numa_node` attribute, None for its -1 ('not known'): as every --json prints it."""
    return numa_node if numa_node >= 0 else None


def place_of(host: Host, found: FoundDevice) -> Place:
    pci = found.functions[0]
    path = tuple(part for part in pci.sys_path.removeprefix("/sys/devices/").split("/") if part)
    return Place(pci.address, path, known_numa(pci.numa_node), host.read_attr(pci.sys_path + "/local_cpulist") or "")


def relation(a: Place, b: Place) -> str:
    if a.address == b.address:
        return SELF
    if a.path[0] != b.path[0]:  # different host bridges (root complexes)
        if a.numa is None or b.numa is None:
            return SYS
        return NODE if a.numa == b.numa else SYS
    common = 0
    while common < min(len(a.path), len(b.path)) and a.path[common] == b.path[common]:
        common += 1
    if common == 1:  # only the host bridge in common
        return PHB
    return PIX if len(a.path) - common <= 2 and len(b.path) - common <= 2 else PXB


def label_prefix(kind: str) -> str:
    """GPU0, NIC0, NPU0, ...: the class of the kind, as admins name them."""
    device_class = kind.partition("/")[2]
    return {"rdma": "NIC"}.get(device_class, device_class.upper())


@dataclass(frozen=True, slots=True)
class Topology:
    labels: tuple[str, ...]
    devices: tuple[FoundDevice, ...]
    places: tuple[Place, ...]

    def relation(self, i: int, j: int) -> str:
        return relation(self.places[i], self.places[j])

    def name(self, i: int) -> str:
        """The CDI name of the device labelled `labels[i]` (its index name, as `list` shows it first)."""
        device = self.devices[i]
        return f"{device.profile.kind}={device.index}"

    def to_json(self) -> dict[str, object]:
        """docs/json.md (`topo`): `devices` ties each matrix label to its CDI name and PCI address, and names
        the devices it is paired with as `list --json` does (`paired_with`); `pairs` by label (`gpu_name` and
        `nic_name` are deprecated: the same names, under `devices`)."""
        pairs = self.pairs()
        paired = self.paired_with(pairs)
        return {
            "devices": {label: {"name": self.name(i), "kind": d.profile.kind, "pci_address": p.address,
                                "numa_node": p.numa, "cpus": p.cpus, "path": list(p.path),
                                "paired_with": [{"name": name, "relation": rel} for name, rel in paired.get(i, ())]}
                        for i, (label, d, p) in enumerate(zip(self.labels, self.devices, self.places, strict=True))},
            "matrix": {a: {b: self.relation(i, j) for j, b in enumerate(self.labels)}
                       for i, a in enumerate(self.labels)},
            "pairs": [{"gpu": self.labels[pair.gpu], "nic": self.labels[pair.nic], "gpu_name": self.name(pair.gpu),
                       "nic_name": self.name(pair.nic), "relation": pair.relation} for pair in pairs],
        }

    def paired_with(self, pairs: list[Pair] | None = None) -> dict[int, list[tuple[str, str]]]:
        """Index into `devices` -> the devices it is paired with (a GPU: its NIC; a NIC: its GPUs), each as
        (CDI name, relation): what `topo --json` and `list --json` both call `paired_with`."""
        paired: dict[int, list[tuple[str, str]]] = {}
        for pair in self.pairs() if pairs is None else pairs:
            for one, other in ((pair.gpu, pair.nic), (pair.nic, pair.gpu)):
                paired.setdefault(one, []).append((self.name(other), pair.relation))
        return paired

    def pairs(self) -> list[Pair]:
        """Each GPU with its closest RDMA NIC: see `pair_gpus_with_nics`."""
        gpus = [i for i, label in enumerate(self.labels) if label.startswith("GPU")]
        nics = [i for i, label in enumerate(self.labels) if label.startswith("NIC")]
        return pair_gpus_with_nics(self, gpus, nics)

    def label_lines(self, width: int) -> list[str]:
        """Which device each label is: its CDI name (as `list` shows it first) and PCI address, one a line."""
        names = [self.name(i) for i in range(len(self.labels))]
        column = max(map(len, names), default=0) + 2
        return [f"  {label:<{width}}{name:<{column}}{place.address}"
                for label, name, place in zip(self.labels, names, self.places, strict=True)]

    def render(self) -> str:
        """The matrix as `nvidia-smi topo -m` prints it, then CPU and NUMA affinity, then which device each
        label is (CDI name, PCI address), the GPU-NIC pairs, and the legend of the relations."""
        width = max([4, *map(len, self.labels)]) + 2
        header = " " * width + "".join(f"{label:<{width}}" for label in self.labels) + "CPU Affinity    NUMA Affinity"
        lines = [header.rstrip()]
        for i, label in enumerate(self.labels):
            cells = "".join(f"{self.relation(i, j):<{width}}" for j in range(len(self.labels)))
            place = self.places[i]
            numa = "N/A" if place.numa is None else str(place.numa)
            lines.append(f"{label:<{width}}{cells}{place.cpus or 'N/A':<16}{numa}".rstrip())
        lines += ["", "Devices:", *self.label_lines(width)]
        pairs = self.pairs()
        if pairs:
            lines += ["", "GPU-NIC pairs (generate --bundles gpu-nic):"]
            paired = {p.gpu: p for p in pairs}
            for i, label in enumerate(self.labels):
                if label.startswith("GPU"):
                    pair = paired.get(i)
                    lines.append(f"  {label:<{width}}" + (f"{self.labels[pair.nic]} ({pair.relation})" if pair
                                                         else "- (no NIC closer than SYS)"))
        return "\n".join([*lines, "", "Legend:", *(f"  {entry}" for entry in LEGEND)]) + "\n"


@dataclass(frozen=True, slots=True)
class Pair:
    gpu: int  # indices into Topology.devices
    nic: int
    relation: str


def pair_gpus_with_nics(topo: Topology, gpus: list[int], nics: list[int]) -> list[Pair]:
    """Each GPU (in order) with its closest NIC: the best relation first (PIX, PXB, PHB, NODE), then the NIC
    with the fewest GPUs paired so far (so two GPUs on one switch with two NICs get one each), then the lower
    NIC. A GPU whose closest NIC is across NUMA nodes (or of an unknown NUMA node) gets none: that bundle
    would be the slow path it exists to avoid. Deterministic: the same tree always gives the same pairs."""
    load = dict.fromkeys(nics, 0)
    pairs = []
    for gpu in gpus:
        candidates = [(RANK[topo.relation(gpu, nic)], load[nic], nic) for nic in nics]
        if not candidates:
            break
        rank, _, nic = min(candidates)
        if rank >= RANK[SYS]:
            continue
        load[nic] += 1
        pairs.append(Pair(gpu, nic, topo.relation(gpu, nic)))
    return pairs


def _quoted(text: str) -> str:
    """A DOT string: quotes and backslashes escaped, line breaks as DOT's `\\n`."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(topo: Topology) -> str:
    """The PCIe tree as Graphviz DOT: one cluster per NUMA node holding its host bridges, the bridges (root
    ports, switch ports) as small ellipses, devices as boxes named as in the matrix, and each GPU-NIC pair as
    a dashed edge labelled with its relation. Host bridges whose devices' NUMA node is unknown stay outside."""
    lines = ["digraph topology {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];',
             '  edge [arrowhead=none];']
    numa_of_bridge: dict[str, set[int | None]] = {}
    cpus_of_numa: dict[int, str] = {}
    for place in topo.places:
        numa_of_bridge.setdefault(place.path[0], set()).add(place.numa)
        if place.numa is not None and place.cpus:
            cpus_of_numa.setdefault(place.numa, place.cpus)
    clusters: dict[int | None, list[str]] = {}
    for bridge, numas in sorted(numa_of_bridge.items()):
        clusters.setdefault(next(iter(numas)) if len(numas) == 1 else None, []).append(bridge)
    for numa, bridges in sorted(clusters.items(), key=lambda item: (item[0] is None, item[0] or 0)):
        shapes = [f"    {_quoted(b)} [shape=house, label={_quoted('host bridge ' + b.removeprefix('pci'))}];"
                  for b in bridges]
        if numa is None:
            lines += [line[2:] for line in shapes]
            continue
        cpus = cpus_of_numa.get(numa)
        title = f"NUMA node {numa}" + (f"\\nCPUs {cpus}" if cpus else "")
        members: dict[str, None] = {}  # the bridges and devices under this cluster's host bridges, once each
        for place in topo.places:
            if place.path[0] in bridges:
                members.update(dict.fromkeys(place.path[1:]))
        lines += [f"  subgraph cluster_numa{numa} {{", f'    label="{title}";', "    style=rounded;", *shapes,
                  *(f"    {_quoted(member)};" for member in members)]
        lines.append("  }")
    edges: dict[tuple[str, str], None] = {}
    bridges_seen: dict[str, None] = {}
    for i, (label, place) in enumerate(zip(topo.labels, topo.places, strict=True)):
        name = topo.name(i)
        lines.append(f"  {_quoted(place.address)} [shape=box, style=filled, fillcolor="
                     f"{'palegreen' if label.startswith('GPU') else 'lightblue'}, "
                     f"label={_quoted(label + chr(10) + name + chr(10) + place.address)}];")
        bridges_seen.update(dict.fromkeys(place.path[1:-1]))
        edges.update(dict.fromkeys(zip(place.path, place.path[1:], strict=False)))
    lines += [f"  {_quoted(b)} [shape=ellipse, label={_quoted(b)}];" for b in bridges_seen]
    lines += [f"  {_quoted(a)} -> {_quoted(b)};" for a, b in edges]
    for pair in topo.pairs():
        lines.append(f"  {_quoted(topo.places[pair.gpu].address)} -> {_quoted(topo.places[pair.nic].address)} "
                     f"[style=dashed, color=darkorange, constraint=false, label={_quoted(pair.relation)}];")
    return "\n".join([*lines, "}"]) + "\n"


def topology(host: Host, found: list[FoundDevice]) -> Topology:
    """GPUs first (as admins read the matrix), then the other kinds; discovery order within a kind."""
    found = sorted(found, key=lambda f: (label_prefix(f.profile.kind) != "GPU", f.profile.kind))
    counters: dict[str, int] = {}
    labels = []
    for item in found:
        prefix = label_prefix(item.profile.kind)
        labels.append(f"{prefix}{counters.get(prefix, 0)}")
        counters[prefix] = counters.get(prefix, 0) + 1
    return Topology(tuple(labels), tuple(found), tuple(place_of(host, item) for item in found))


# --- placement ------------------------------------------------------------------------------------------
# The relations nest: same switch within same root port within same host bridge within same NUMA node within
# all. So the best worst-pair relation for k devices is the tightest class that holds k of them, found per
# level without enumerating combinations (linear in devices, so a 1,024-device node is no harder).

def _class_key(place: Place, level: str) -> tuple[object, ...]:
    if level == PIX:
        return ("pix", place.path[:-2])  # the same switch upstream port (or slot) above both
    if level == PXB:
        return ("pxb", place.path[:2])  # the same root port
    if level == PHB:
        return ("phb", place.path[0])  # the same host bridge
    if level == NODE:  # a NUMA node the kernel does not know is a class of its own, never merged
        return ("node", place.numa) if place.numa is not None else ("bridge", place.path[0])
    return ("sys",)


def place_devices(places: list[Place], count: int, must_include: tuple[str, ...] = (), *,
                  highest: bool = False) -> list[str]:
    """`count` PCI addresses from `places` (the available devices) whose worst pair is as close as any choice
    allows, including every address in `must_include`; ties go to the lowest addresses (`highest`: to the
    highest). [] when impossible."""
    by_address = {p.address: p for p in places}
    if count > len(places) or len(must_include) > count or any(a not in by_address for a in must_include):
        return []
    order = {address: n for n, address in enumerate(sorted(by_address, reverse=highest))}
    for level in (PIX, PXB, PHB, NODE, SYS):
        classes: dict[tuple[object, ...], list[Place]] = {}
        for item in sorted(places, key=lambda p: order[p.address]):
            classes.setdefault(_class_key(item, level), []).append(item)
        fitting = [members for members in classes.values() if len(members) >= count and
                   all(a in {m.address for m in members} for a in must_include)]
        if fitting:
            members = min(fitting, key=lambda group: order[group[0].address])
            chosen = [by_address[a] for a in must_include]
            rest = [m for m in members if m.address not in must_include]
            while len(chosen) < count:  # the next closest to what is already chosen, then the first in order
                best = min(rest, key=lambda m: (max((RANK[relation(m, c)] for c in chosen), default=0),
                                                order[m.address]))
                chosen.append(best)
                rest.remove(best)
            return sorted(c.address for c in chosen)
    return []
