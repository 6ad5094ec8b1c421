"""ResourceSlices as a pure function of what discovery finds (docs/dra.md).

One pool per kind per node (`<node>-<vendor>-<class>`, e.g. `node1-nvidia-com-gpu`); a device's name comes
from its PCI address (`gpu-0000-18-00-0`, a MIG instance `gpu-0000-07-00-0-gi1-ci0`), so it is the same after
every restart and a DNS label. Each device carries the standard attributes (`resource.kubernetes.io/pciBusID`,
`pcieRoot`: its PCIe root complex `pci<domain>:<bus>`, the first element of its sysfs path, so a GPU and a NIC
under one root share it; `numaNode`, left out when the kernel says -1) and the driver's own (kind, vendor,
model, index, driverVersion, uuid, partition: `whole`, `mig` or `amd`; an NVIDIA GPU's `type`, `gpu` or `mig`,
as NVIDIA's DRA driver gives it and its DeviceClasses test), and where NVML answers (discovery/nvml.py)
NVIDIA's names for its facts (productName, brand, architecture, cudaComputeCapability, cudaDriverVersion; a MIG
device's `profile`); capacity `memory` where NVML (a GPU's, a MIG device's) or sysfs (AMD's VRAM) states it.

A GPU split into MIG instances (or AMD partitions) is published whole *and* as its instances, which consume
a counter set of the parent (partitionable devices, beta and on in 1.36): each instance one counter of its
own, the whole device all of them, so the scheduler never gives the whole GPU and one of its instances to two
claims. The counter sets go in a slice of their own (the API allows devices or sharedCounters in one slice,
not both), and no slice holds more devices than the API allows (128; 64 when any of them consumes counters or
carries taints: a pool with a tainted device is cut in slices of 64).

A device the health loop took out stays in its slice with `DeviceTaint`s (`resource.k8s.io/v1`,
`DRADeviceTaints`, beta and on in 1.36): one per fault, keyed `<driver>/<cause>` (`dra.devinject.io/xid`,
`/aer-fatal`, `/unbound`, `/gone`, ...), the fault's particular as the value, `NoSchedule` (the scheduler
places no new claim on it) or `NoExecute` (the taint-eviction controller also evicts the pods using it).

A family of char-node devices (IMEX channels, discovery/channels.py) is a pool of its own too: channel N is
device `channel-N` (the name NVIDIA's DRA driver gives it) with `type` `channel` and `id` N (its attributes
there too), its kind, vendor and `partition` `whole`, and no PCI attribute (it has no PCI function).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from devinject.cdi.model import DeviceNode
from devinject.discovery.channels import ChannelDevice
from devinject.discovery.discover import FoundDevice
from devinject.discovery.node import Node
from devinject.discovery.nvml import GpuFacts, NvmlFacts
from devinject.discovery.partitions import Partition
from devinject.discovery.topology import place_of
from devinject.dra.capacity import CapacitySharing, binary_quantity, capacity_json, device_capacity

DRIVER = "dra.devinject.io"
STANDARD = "resource.kubernetes.io"
NVIDIA_GPU = "nvidia.com/gpu"
MAX_DEVICES = 128  # per slice (resource.k8s.io/v1 validation)
MAX_DEVICES_WITH_COUNTERS = 64  # per slice when any device consumes counters or carries taints
MAX_TAINTS = 16  # per device (resource.k8s.io/v1 validation: DeviceTaintsMaxLength)
MAX_LABEL_VALUE = 63
NO_SCHEDULE, NO_EXECUTE = "NoSchedule", "NoExecute"  # `None` (1.35+) is never written: a fault keeps claims off
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")


def label(text: str) -> str:
    """`text` as a DNS label: lower case, runs of anything else than [a-z0-9-] as one `-`, trimmed."""
    return _NOT_LABEL.sub("-", text.lower()).strip("-")


def label_value(text: str) -> str:
    """`text` as a label value (a taint's value): at most 63 of [A-Za-z0-9._-], starting and ending with an
    alphanumeric; anything else as `-`."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:MAX_LABEL_VALUE]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


@dataclass(frozen=True, slots=True)
class Taint:
    """One `DeviceTaint` of a device: `key` `<driver>/<cause>`, `value` the fault's particular, `effect`
    NoSchedule or NoExecute, `time_added` (RFC 3339, seconds) when the driver first published it."""

    key: str
    value: str
    effect: str
    time_added: str

    def to_json(self) -> dict[str, str]:
        out = {"key": self.key, "effect": self.effect, "timeAdded": self.time_added}
        if self.value:
            out["value"] = self.value
        return out


def pool_name(node_name: str, kind: str) -> str:
    return f"{node_name}-{label(kind)}"


def device_name(found: FoundDevice, partition: Partition | None = None) -> str:
    """`<class>-<PCI address>` (`gpu-0000-18-00-0`), `-<partition key>` for one of its partitions."""
    name = f"{label(found.profile.kind.partition('/')[2])}-{label(found.address)}"
    return f"{name}-{partition.key}" if partition is not None else name


def counter_set_name(found: FoundDevice) -> str:
    return f"{device_name(found)}-partitions"


@dataclass(frozen=True, slots=True)
class Offer:
    """One device the driver offers: what the slice says about it and what a claim on it prepares."""

    pool: str
    name: str
    kind: str
    found: FoundDevice | None  # a whole device: its partitions left out (the whole GPU's own edits); None: a channel
    partition: Partition | None
    attributes: tuple[tuple[str, dict[str, object]], ...]
    capacity: tuple[tuple[str, str], ...] = ()
    consumes: tuple[str, ...] = ()  # counters of the parent's counter set this device consumes
    channel: ChannelDevice | None = None  # a char-node device (an IMEX channel), which has no PCI function
    taints: tuple[Taint, ...] = ()  # the faults the health loop found, while it keeps the device out
    shareable: tuple[tuple[str, int], ...] = ()  # consumable capacity (dra/capacity.py): several claims share it

    @property
    def device(self) -> FoundDevice:
        """The PCI device of an offer that is not a channel's."""
        assert self.found is not None, f"{self.name} is a channel"
        return self.found

    @property
    def nodes(self) -> tuple[DeviceNode, ...]:
        """The device nodes the offer stands for: its channel's, its partition's or its device's."""
        if self.channel is not None:
            return (self.channel.node,)
        return self.partition.nodes if self.partition is not None else self.device.nodes

    def to_json(self) -> dict[str, object]:
        device: dict[str, object] = {"name": self.name, "attributes": dict(self.attributes)}
        if self.shareable:
            device["allowMultipleAllocations"] = True
            device["capacity"] = capacity_json(dict(self.shareable))
        elif self.capacity:  # bytes as the API server stores them (81559Mi), so a slice read back is the same
            device["capacity"] = {name: {"value": binary_quantity(int(value)) if value.isdigit() else value}
                                  for name, value in self.capacity}
        if self.consumes:
            device["consumesCounters"] = [{"counterSet": counter_set_name(self.device),
                                           "counters": {c: {"value": "1"} for c in self.consumes}}]
        if self.taints:
            device["taints"] = [t.to_json() for t in self.taints[:MAX_TAINTS]]
        return device


def _version(value: str) -> dict[str, object]:
    """A `version` attribute when the text is semantic (550.54.15), else a string (535.104.05 is not)."""
    return {"version": value} if _SEMVER.match(value) else {"string": value}


def _memory(size: int | None) -> tuple[tuple[str, str], ...]:
    return (("memory", str(size)),) if size else ()


def _padded_version(text: str) -> dict[str, object]:
    """NVML's `9.0` (a compute capability), `12.4` (a CUDA version) as the semantic version NVIDIA's DRA driver
    publishes (`9.0.0`)."""
    return _version(".".join([*text.split("."), "0", "0"][:3]))


def nvml_attributes(gpu: GpuFacts | None, facts: NvmlFacts) -> dict[str, dict[str, object]]:
    """A GPU's attributes from NVML, under the names NVIDIA's DRA driver gives them (selectors written for it
    read these too): productName, brand, architecture, cudaComputeCapability and cudaDriverVersion (versions)."""
    if gpu is None:
        return {}
    out: dict[str, dict[str, object]] = {}
    for name, text in (("productName", gpu.product_name), ("brand", gpu.brand), ("architecture", gpu.architecture)):
        if text:
            out[name] = {"string": text}
    if gpu.cuda_compute_capability:
        out["cudaComputeCapability"] = _padded_version(gpu.cuda_compute_capability)
    if facts.cuda_driver_version:
        out["cudaDriverVersion"] = _padded_version(facts.cuda_driver_version)
    return out


def offers(node: Node, node_name: str, driver_versions: dict[str, str | None] | None = None) -> list[Offer]:
    """Every device of the node as the driver offers it, in discovery order (a partitioned device's
    instances right after it), then its channels by number. `driver_versions`: kind -> the running driver's
    version (None: not known)."""
    versions = driver_versions or {}
    out: list[Offer] = []
    for found in node.devices():
        kind = found.profile.kind
        place = place_of(node.host, found)
        common: dict[str, dict[str, object]] = {
            f"{STANDARD}/pciBusID": {"string": found.address},
            f"{STANDARD}/pcieRoot": {"string": place.path[0]},
        }
        if place.numa is not None:
            common[f"{STANDARD}/numaNode"] = {"int": place.numa}
        common["kind"] = {"string": kind}
        common["vendor"] = {"string": found.profile.vendor_name or kind.partition("/")[0]}
        common["pciVendorID"] = {"string": f"0x{found.pci.vendor:04x}"}
        if found.model:
            common["model"] = {"string": found.model}
        common["index"] = {"int": found.index}
        gpu = node.gpu_facts(found)
        driver_version = versions.get(kind) or (node.nvml_facts().driver_version if gpu else None)
        if driver_version:
            common["driverVersion"] = _version(str(driver_version))
        common.update(nvml_attributes(gpu, node.nvml_facts()))
        whole: dict[str, dict[str, object]] = {**common, "partition": {"string": "whole"}}  # for CEL selectors
        if kind == NVIDIA_GPU:  # NVIDIA's DRA driver's type, which its DeviceClass tests (`type == 'gpu'`)
            whole["type"] = {"string": "gpu"}
        if found.uuid:
            whole["uuid"] = {"string": found.uuid}
        pool = pool_name(node_name, kind)
        keys = tuple(p.key for p in found.partitions)
        out.append(Offer(pool, device_name(found), kind, replace(found, partitions=()), None,
                         tuple(whole.items()), _memory(node.memory_bytes(found)), keys))
        for partition in found.partitions:
            attributes = dict(common)
            attributes["partition"] = {"string": partition.kind}
            attributes["partitionName"] = {"string": partition.name}
            attributes["parentName"] = {"string": device_name(found)}
            if kind == NVIDIA_GPU and partition.kind == "mig":
                attributes["type"] = {"string": "mig"}  # NVIDIA's driver's, which its mig.nvidia.com class tests
            if partition.uuid:
                attributes["uuid"] = {"string": partition.uuid}
            mig = gpu.mig(partition.gpu_instance, partition.compute_instance) if gpu is not None else None
            if mig is not None and mig.profile:
                attributes["profile"] = {"string": mig.profile}  # `1g.10gb`, as NVIDIA's driver names it
            out.append(Offer(pool, device_name(found, partition), kind, found, partition,
                             tuple(attributes.items()), _memory(mig.memory_bytes if mig else None), (partition.key,)))
    return out + [channel_offer(channel, node_name) for channel in node.channels()]


def channel_offer(channel: ChannelDevice, node_name: str) -> Offer:
    """Channel N as NVIDIA's DRA driver names and describes it (`channel-N`, `type` `channel`, `id` N), with
    its kind, vendor and partition (`whole`): no PCI, PCIe root or NUMA attribute (a char node, no PCI function)."""
    kind = channel.profile.kind
    attributes: dict[str, dict[str, object]] = {
        "kind": {"string": kind}, "vendor": {"string": channel.profile.vendor_name or kind.partition("/")[0]},
        "type": {"string": "channel"}, "id": {"int": channel.number},
        "partition": {"string": "whole"}}  # always set: a selector testing it alone never meets a missing attribute
    return Offer(pool_name(node_name, kind), f"channel-{channel.number}", kind, None, None,
                 tuple(attributes.items()), channel=channel)


def shareable(offered: list[Offer], sharing: CapacitySharing | None) -> list[Offer]:
    """The offers with consumable capacity where the admin opted in: each whole PCI device not split into
    partitions (a MIG-split GPU's instances are its sharing) gets its shares and memory (dra/capacity.py)."""
    if sharing is None:
        return offered
    out = []
    for offer in offered:
        if offer.found is None or offer.partition is not None or offer.consumes:
            out.append(offer)
            continue
        vram = dict(offer.capacity).get("memory")
        capacity = device_capacity(sharing, int(vram) if vram and vram.isdigit() else None)
        out.append(replace(offer, shareable=tuple(capacity.items())))
    return out


def _chunks(items: list[Offer], size: int) -> list[list[Offer]]:
    return [items[i:i + size] for i in range(0, len(items), size)] or [[]]


def pool_slices(driver: str, node_name: str, pool: str, offered: list[Offer],
                generation: int) -> list[dict[str, object]]:
    """The ResourceSlice objects of one pool at `generation`: its counter sets in a slice of their own (when
    any), then its devices, at most as many per slice as the API allows. Names are stable
    (`<driver>-<pool>-<n>`), so an update replaces the same objects."""
    counter_sets = []
    for offer in offered:
        if offer.partition is None and offer.consumes:
            counter_sets.append({"name": counter_set_name(offer.device),
                                 "counters": {c: {"value": "1"} for c in offer.consumes}})
    size = MAX_DEVICES_WITH_COUNTERS if counter_sets or any(o.taints for o in offered) else MAX_DEVICES
    specs: list[dict[str, object]] = []
    if counter_sets:
        specs.append({"sharedCounters": counter_sets})
    specs += [{"devices": [offer.to_json() for offer in chunk]} for chunk in _chunks(offered, size)]
    slices: list[dict[str, object]] = []
    for n, body in enumerate(specs):
        slices.append({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{label(driver)}-{pool}-{n}",
                         "labels": {"app.kubernetes.io/managed-by": "devinject", f"{driver}/pool": pool}},
            "spec": {"driver": driver, "nodeName": node_name,
                     "pool": {"name": pool, "generation": generation, "resourceSliceCount": len(specs)},
                     **body},
        })
    return slices


def by_pool(offered: list[Offer]) -> dict[str, list[Offer]]:
    pools: dict[str, list[Offer]] = {}
    for offer in offered:
        pools.setdefault(offer.pool, []).append(offer)
    return pools


def resource_slices(driver: str, node_name: str, offered: list[Offer],
                    generations: dict[str, int] | None = None) -> list[dict[str, object]]:
    """Every slice of the node: one pool per kind, each at its generation (default 1)."""
    gens = generations or {}
    return [s for pool, items in by_pool(offered).items()
            for s in pool_slices(driver, node_name, pool, items, gens.get(pool, 1))]
