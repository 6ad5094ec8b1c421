"""What the device plugin offers and answers, as plain data (no gRPC here, so every rule is unit-tested).

Device IDs are PCI addresses (a partition: `<address>-gi<G>-ci<C>` for MIG, `<address>-part<N>` for AMD;
an IMEX channel, which is no PCI function: `channel-<N>`): stable across plugin and kubelet restarts, unique
on the node, and the names `devinject list` and the kernel use. An allocation answers, per container, with

- `cdi_devices`: the CDI names (`nvidia.com/gpu=0`) for kubelets and runtimes that apply CDI specs;
- a fallback for runtimes without CDI (containerd 1.6, CRI-O without CDI), built from the same spec: the
  device nodes (`devices`), the spec's driver files read-only (`mounts`, including the SONAME links its
  create-symlinks hook would make), its env (`envs`);
- the `cdi.k8s.io/devinject_<resource>` annotation the devinject hook reads on runc nodes.
"""

from __future__ import annotations

import itertools
import posixpath
from dataclasses import dataclass, field, replace

from devinject.cdi.model import ContainerEdits, Spec
from devinject.core.errors import DevinjectError
from devinject.discovery.topology import Place, place_devices

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"  # the kubelet's words
ANNOTATION_PREFIX = "cdi.k8s.io/devinject_"


class AllocationError(DevinjectError):
    """A request the plugin refuses whole (unknown or unhealthy device IDs)."""


@dataclass(frozen=True, slots=True)
class PluginDevice:
    id: str  # the PCI address (channel-N for an IMEX channel)
    cdi_name: str  # kind=index
    healthy: bool
    place: Place
    nodes: tuple[str, ...] = ()  # its device nodes ("c 195:0"), as the ledger books them
    shared: tuple[str, ...] = ()  # those of them others may hold too (a MIG instance's parent GPU)
    held: str = ""  # why the other path (a DRA claim) holds it: offered Unhealthy, never allocated
    parent: str = ""  # a time-sliced replica's device (its ID without `::<k>`); "" for a device of its own
    replicas: int = 1  # how many replicas its device is offered as (deviceplugin/sharing.py)

    @property
    def offered(self) -> bool:
        """Healthy in the kubelet's list: healthy and not held through DRA."""
        return self.healthy and not self.held


@dataclass(frozen=True, slots=True)
class ContainerAnswer:
    cdi_devices: tuple[str, ...]
    devices: tuple[tuple[str, str, str], ...] = ()  # (container path, host path, cgroup permissions)
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (container path, host path, read-only)
    envs: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def annotation_key(resource: str) -> str:
    """`cdi.k8s.io/devinject_nvidia.com_gpu`: a valid annotation name (one per resource, so containers with
    several resources keep every request)."""
    return ANNOTATION_PREFIX + resource.replace("/", "_")


def _chosen(devices: dict[str, PluginDevice], ids: list[str]) -> list[PluginDevice]:
    unknown = [i for i in ids if i not in devices]
    if unknown:
        raise AllocationError(f"unknown device ID {unknown[0]} (offered: {', '.join(sorted(devices)) or 'none'})")
    sick = [i for i in ids if not devices[i].healthy]
    if sick:
        raise AllocationError(f"device {sick[0]} is unhealthy; not allocated")
    held = [i for i in ids if devices[i].held]
    if held:
        raise AllocationError(f"device {held[0]} is {devices[held[0]].held}; not allocated")
    if len(set(ids)) != len(ids):
        raise AllocationError(f"device IDs repeated in one request: {', '.join(ids)}")
    return [devices[i] for i in ids]


def _links(edits: ContainerEdits) -> list[tuple[str, str]]:
    """(link, target) pairs the spec's create-symlinks (or links-and-ldcache) hook makes, targets absolute."""
    pairs = []
    for hook in edits.hooks:
        args = list(hook.args)
        if "create-symlinks" not in args and "links-and-ldcache" not in args:
            continue
        for flag, value in itertools.pairwise(args):
            if flag == "--link" and "::" in value:
                target, link = value.split("::", 1)
                pairs.append((link, posixpath.join(posixpath.dirname(link), target)))
    return pairs


def answer(resource: str, spec: Spec, devices: dict[str, PluginDevice], ids: list[str], *,
           fallback: bool = True) -> ContainerAnswer:
    """One container's allocation of `ids` from `resource`, built from its CDI `spec`. All or nothing."""
    chosen = _chosen(devices, ids)
    names = tuple(dict.fromkeys(d.cdi_name for d in chosen))  # replicas of one device: its CDI device once
    by_name = {device.name: device.edits for device in spec.devices}
    edits = spec.edits
    for device in {d.cdi_name: d for d in chosen}.values():
        own = by_name.get(device.cdi_name.partition("=")[2])
        if own is None:
            raise AllocationError(f"device {device.id}: {device.cdi_name} is not in the {spec.kind} spec")
        edits = edits.merge(own)
    annotations = {annotation_key(resource): ",".join(names)}
    if not fallback:
        return ContainerAnswer(names, annotations=annotations)
    nodes = tuple((n.path, n.host_path or n.path, n.permissions or "rw") for n in edits.device_nodes)
    mounts = [(m.container_path, m.host_path, "ro" in m.options or "readonly" in m.options) for m in edits.mounts]
    host_of = {m[0]: m[1] for m in mounts}
    links = dict(_links(edits))
    for link in links:  # a link to a link (libcuda.so -> libcuda.so.1 -> the file): follow to the mount
        target = links[link]
        for _ in range(8):
            if target in host_of or target not in links:
                break
            target = links[target]
        if target in host_of:
            mounts.append((link, host_of[target], True))
    envs = dict(entry.split("=", 1) for entry in edits.env if "=" in entry)
    return ContainerAnswer(names, nodes, tuple(dict.fromkeys(mounts)), envs, annotations)


def preferred(devices: dict[str, PluginDevice], available: list[str], must_include: list[str],
              size: int, avoid: set[str] | frozenset[str] = frozenset(), *, from_top: bool = False) -> list[str]:
    """The `size` available devices closest in the PCIe/NUMA tree (same switch before same NUMA node before
    across sockets), including `must_include`; the kubelet's own choice (the first ones) if that fails.
    `avoid`: devices the other path holds now (the kubelet's list may not show it yet), left out while
    enough others are available. `from_top`: ties go to the highest IDs, away from the lowest ones the
    scheduler's DRA allocator takes first (it takes a slice's devices in order), so that the two paths on one
    node meet only over the last free devices."""
    free = [i for i in available if i not in avoid or i in must_include]
    if len(free) >= size:
        available = free
    places = [replace(devices[i].place, address=i) for i in available if i in devices]  # by ID: MIG siblings
    chosen = place_devices(places, size, tuple(i for i in must_include if i in devices), highest=from_top)
    if chosen:
        return chosen
    rest = [i for i in available if i not in must_include]
    return [*must_include, *(reversed(rest) if from_top else rest)][:size]
