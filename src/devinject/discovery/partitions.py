"""Partitions of a device offered instead of the whole device. NVIDIA MIG, read from procfs alone (no NVML):
a GPU whose capability directory `/proc/driver/nvidia/capabilities/gpu<minor>/mig` holds GPU instances
(`gi<G>/access`) with compute instances (`gi<G>/ci<C>/access`) is offered as one device per compute
instance: the parent's `/dev/nvidia<minor>` plus the GI and CI capability nodes, whose minors the driver
writes in each `access` file (`DeviceFileMinor: N`) under the `nvidia-caps` major (sysfs-facts §2.3)."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from devinject.core.model import DeviceNode
from devinject.discovery.host import Host
from devinject.discovery.procfs import parse_key_values

_GI = re.compile(r"^gi(\d+)$")
_CI = re.compile(r"^ci(\d+)$")


@dataclass(frozen=True, slots=True)
class Partition:
    name: str  # `<index>:<j>`, j counting the device's partitions in (GI, CI) order, as NVIDIA names them
    gpu_instance: int
    compute_instance: int
    nodes: tuple[DeviceNode, ...]  # the parent node first, then the capability nodes


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
    common = [DeviceNode(node_path.format(cap_minor=c.minor), type="c", major=caps_major, minor=c.minor,
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
            nodes = [parent, *(DeviceNode(node_path.format(cap_minor=c.minor), type="c", major=caps_major,
                                          minor=c.minor, file_mode=c.mode) for c in (gi_cap, ci_cap)), *common]
            out.append(Partition(f"{index}:{len(out)}", gi, ci, tuple(dict.fromkeys(nodes))))
    return out
