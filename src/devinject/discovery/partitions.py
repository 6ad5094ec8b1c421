"""Partitions of a device, offered instead of the whole device (sysfs-facts §2.3, §3):

- NVIDIA MIG, from procfs alone (no NVML): a GPU whose capability directory
  `/proc/driver/nvidia/capabilities/gpu<minor>/mig` holds GPU instances (`gi<G>/access`) with compute
  instances (`gi<G>/ci<C>/access`) is offered as one device per compute instance: the parent's
  `/dev/nvidia<minor>` plus the GI and CI capability nodes, whose minors the driver writes in each `access`
  file (`DeviceFileMinor: N`) under the `nvidia-caps` major.
- AMD compute partitions (MI300 CPX, DPX, ...): every KFD topology node whose `domain` and `location_id`
  (`bus << 8 | devfn`, the partition in the low bits of devfn) are the GPU's is one partition, with its own
  render node (`drm_render_minor`). A GPU with one such node is not partitioned."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass

from devinject.cdi.model import DeviceNode
from devinject.discovery.host import Host
from devinject.discovery.procfs import parse_key_values

_GI = re.compile(r"^gi(\d+)$")
_CI = re.compile(r"^ci(\d+)$")


@dataclass(frozen=True, slots=True)
class Partition:
    kind: str  # "mig" or "amd"
    name: str  # `<index>:<j>`, j counting the device's partitions in (GI, CI) order, as NVIDIA names them
    gpu_instance: int
    compute_instance: int
    nodes: tuple[DeviceNode, ...]  # the parent node first, then the capability nodes
    uuid: str | None = None  # a MIG device's UUID, from NVML when it answers

    @property
    def key(self) -> str:
        """Stable within its device while the partitioning stays: `gi1-ci0` (MIG), `part3` (AMD)."""
        return f"gi{self.gpu_instance}-ci{self.compute_instance}" if self.kind == "mig" else f"part{self.gpu_instance}"


@dataclass(frozen=True, slots=True)
class CapabilityNode:
    minor: int
    mode: int | None


def read_capability(host: Host, path: str) -> CapabilityNode | None:
    """`DeviceFileMinor: 33\\nDeviceFileMode: 292\\n...` -> its minor and mode (None when unreadable)."""
    values = parse_key_values(host.read_text(path) or "")
    try:
        minor = int(values["DeviceFileMinor"])
    except (KeyError, ValueError):
        return None
    try:
        mode = int(values["DeviceFileMode"])
    except (KeyError, ValueError):
        mode = None
    return CapabilityNode(minor, mode)


def mig_partitions(host: Host, caps_dir: str, node_path: str, caps_major: int, parent: DeviceNode,
                   index: int, shared_caps: tuple[str, ...] = ()) -> list[Partition]:
    """The MIG devices of one GPU, or [] when it has no GPU instance (offered whole)."""
    extra = [read_capability(host, path) for path in shared_caps]
    common = [DeviceNode(node_path.format(minor=c.minor), type="c", major=caps_major, minor=c.minor,
                         file_mode=c.mode) for c in extra if c is not None]
    out: list[Partition] = []
    instances = sorted((int(m.group(1)), name) for name in host.listdir(caps_dir) if (m := _GI.match(name)))
    for gi, gi_name in instances:
        gi_dir = posixpath.join(caps_dir, gi_name)
        gi_cap = read_capability(host, posixpath.join(gi_dir, "access"))
        if gi_cap is None:
            continue
        computes = sorted((int(m.group(1)), name) for name in host.listdir(gi_dir) if (m := _CI.match(name)))
        for ci, ci_name in computes:
            ci_cap = read_capability(host, posixpath.join(gi_dir, ci_name, "access"))
            if ci_cap is None:
                continue
            nodes = [parent, *(DeviceNode(node_path.format(minor=c.minor), type="c", major=caps_major,
                                          minor=c.minor, file_mode=c.mode) for c in (gi_cap, ci_cap)), *common]
            out.append(Partition("mig", f"{index}:{len(out)}", gi, ci, tuple(dict.fromkeys(nodes))))
    return out


def _kfd_properties(text: str) -> dict[str, int]:
    """`key <decimal>` lines of a KFD topology node's `properties` (unparsable lines skipped)."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


def kfd_partitions(host: Host, nodes_dir: str, address: str, node_path: str, major: int,
                   node_for: Callable[[str, int, int], DeviceNode], index: int) -> list[Partition]:
    """The compute partitions of the GPU at PCI `address` from the KFD topology, or [] when it has one."""
    domain, bus, devfn = int(address[:4], 16), int(address[5:7], 16), int(address[8:10], 16) << 3
    found: list[tuple[int, int]] = []  # (location_id, render minor)
    for name in host.listdir(nodes_dir):
        props = _kfd_properties(host.read_text(posixpath.join(nodes_dir, name, "properties")) or "")
        location, minor = props.get("location_id"), props.get("drm_render_minor")
        if location is None or minor is None or minor <= 0 or props.get("domain", 0) != domain:
            continue
        if location >> 8 == bus and (location & 0xFF) & ~0x7 == devfn:  # the low bits carry the partition
            found.append((location, minor))
    if len(found) < 2:
        return []
    return [Partition("amd", f"{index}:{j}", j, 0, (node_for(node_path.format(minor=minor), major, minor),))
            for j, (_, minor) in enumerate(sorted(found))]
