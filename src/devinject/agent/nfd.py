"""Node labels through Node Feature Discovery's local feature source: a feature file in
`/etc/kubernetes/node-feature-discovery/features.d/` (one `name=value` per line, `#` comments; nfd-worker
skips dot-files, so the file is written as a dot-file and renamed into place), as NVIDIA's GPU feature
discovery does. Per kind, under the `devinject.io/` label namespace:

    devinject.io/accelerators=true
    devinject.io/nvidia.com-gpu.count=8            healthy devices offered (taken-out ones not counted)
    devinject.io/nvidia.com-gpu.product=NVIDIA-H100-80GB-HBM3
    devinject.io/nvidia.com-gpu.driver=550.54.14
    devinject.io/nvidia.com-gpu.partitions=2       MIG instances (AMD partitions), when there are any
    devinject.io/nvidia.com-gpu.numa0=4            devices per NUMA node

and where NVML describes the kind's GPUs (discovery/nvml.py; the most common value when they differ), under
the names NVIDIA's GPU feature discovery gives them after `nvidia.com/` (docs/deploy.md, "Labels"):

    devinject.io/nvidia.com-gpu.memory=81559       MiB (GFD: nvidia.com/gpu.memory)
    devinject.io/nvidia.com-gpu.compute.major=9    (GFD: nvidia.com/gpu.compute.major, .minor)
    devinject.io/nvidia.com-gpu.compute.minor=0
    devinject.io/nvidia.com-gpu.family=hopper      (GFD: nvidia.com/gpu.family)
    devinject.io/nvidia.com-mig-3g.40gb.count=2    MIG devices per profile (GFD: nvidia.com/mig-3g.40gb.count)
    devinject.io/nvidia.com-mig-3g.40gb.memory=40192   MiB of one (GFD: nvidia.com/mig-3g.40gb.memory)

Names and values follow Kubernetes' label rules (a name of at most 63 characters of `[A-Za-z0-9._-]`
beginning and ending alphanumeric; a value likewise, or empty), which NFD enforces: anything else is
rewritten to `-` and cut to 63 characters.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devinject.discovery.discover import FoundDevice
    from devinject.discovery.host import Host
    from devinject.discovery.nvml import GpuFacts

FEATURE_FILE = "devinject"
NAMESPACE = "devinject.io"
_NOT_LABEL = re.compile(r"[^A-Za-z0-9._-]+")


def label_part(text: str) -> str:
    """`text` as a label name segment or value: invalid runs become `-`, at most 63 characters, alphanumeric
    at both ends."""
    return _NOT_LABEL.sub("-", text)[:63].strip("-._")


def _most_common(values: list[object]) -> object | None:
    return Counter(values).most_common(1)[0][0] if values else None


def nvml_features(kind: str, items: list[FoundDevice], facts: list[GpuFacts]) -> list[str]:
    """The labels NVML's facts of a kind's devices give: memory (MiB), compute capability, family, and each MIG
    profile's device count and memory (MiB)."""
    from devinject.discovery.nvml import architecture_family, mig_resource

    prefix = f"{NAMESPACE}/{label_part(kind.replace('/', '-'))}"
    lines = []
    memory = _most_common([f.memory_bytes >> 20 for f in facts if f.memory_bytes])
    if memory is not None:
        lines.append(f"{prefix}.memory={memory}")
    capability = _most_common([f.compute_capability for f in facts if f.compute_capability is not None])
    if isinstance(capability, tuple):
        lines += [f"{prefix}.compute.major={capability[0]}", f"{prefix}.compute.minor={capability[1]}"]
    family = _most_common([family for f in facts if (family := architecture_family(f))])
    if family is not None:
        lines.append(f"{prefix}.family={label_part(str(family))}")
    by_address = {f.bus_id: f for f in facts}
    profiles: Counter[str] = Counter()
    memories: dict[str, int] = {}
    for item in items:
        gpu = by_address.get(item.address)
        if gpu is None:
            continue
        for part in item.partitions:
            mig = gpu.mig(part.gpu_instance, part.compute_instance) if part.kind == "mig" else None
            if mig is not None and mig.profile:
                profiles[mig.profile] += 1
                if mig.memory_bytes:
                    memories.setdefault(mig.profile, mig.memory_bytes >> 20)
    for profile, count in sorted(profiles.items()):
        name = f"{NAMESPACE}/{label_part(mig_resource(kind, profile).replace('/', '-'))}"
        lines.append(f"{name}.count={count}")
        if profile in memories:
            lines.append(f"{name}.memory={memories[profile]}")
    return lines


def features(host: Host, found: list[FoundDevice], *, out: frozenset[str] = frozenset(),
             gpu_facts: Callable[[FoundDevice], GpuFacts | None] | None = None) -> list[str]:
    """The feature file's lines for the devices `found` (those whose key is in `out` not counted); `gpu_facts`:
    NVML's facts of a device (discovery/node.py `Node.gpu_facts`), for the labels they give."""
    from devinject.cdi.identity import device_key
    from devinject.discovery.topology import known_numa
    from devinject.specs.generate import driver_version

    by_kind: dict[str, list[FoundDevice]] = {}
    for item in found:
        if device_key(item.profile.kind, item.address) not in out:
            by_kind.setdefault(item.profile.kind, []).append(item)
    lines = ["# devinject: the accelerators of this node, per kind (docs/deploy.md, \"Labels\")"]
    if by_kind:
        lines.append(f"{NAMESPACE}/accelerators=true")
    for kind, items in sorted(by_kind.items()):
        prefix = f"{NAMESPACE}/{label_part(kind.replace('/', '-'))}"
        lines.append(f"{prefix}.count={len(items)}")
        models = Counter(item.model for item in items if item.model)
        if models:
            lines.append(f"{prefix}.product={label_part(models.most_common(1)[0][0])}")
        version = driver_version(host, items[0].profile, [])
        if version:
            lines.append(f"{prefix}.driver={label_part(version)}")
        partitions = sum(len(item.partitions) for item in items)
        if partitions:
            lines.append(f"{prefix}.partitions={partitions}")
        numa = Counter(known_numa(item.pci.numa_node) for item in items)
        for node, count in sorted((n, c) for n, c in numa.items() if n is not None):
            lines.append(f"{prefix}.numa{node}={count}")
        facts = [f for item in items if gpu_facts is not None and (f := gpu_facts(item)) is not None]
        if facts:
            lines += nvml_features(kind, items, facts)
    return lines


def write_features(directory: str, lines: list[str]) -> bool:
    """Write the feature file into `directory` atomically (a dot-file renamed into place), only when it
    changed; True when written. As root writes (linux/trusteddir.write_file): a directory someone but root
    could change, or one above it, is refused (OSError, its strerror the one line)."""
    import errno
    import os

    from devinject.core.errors import DevinjectError
    from devinject.linux.trusteddir import write_file

    path = os.path.join(directory, FEATURE_FILE)
    text = "\n".join(lines) + "\n"
    try:
        with open(path, encoding="utf-8") as handle:
            if handle.read() == text:
                return False
    except (OSError, UnicodeDecodeError):
        pass
    try:
        write_file(path, text.encode(), 0o644, what="NFD feature file", sync=True)
    except DevinjectError as err:  # the callers log and go on: an OSError to them
        raise OSError(errno.EPERM, err.message) from None
    return True
