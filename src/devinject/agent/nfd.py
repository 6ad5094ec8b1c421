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

Names and values follow Kubernetes' label rules (a name of at most 63 characters of `[A-Za-z0-9._-]`
beginning and ending alphanumeric; a value likewise, or empty), which NFD enforces: anything else is
rewritten to `-` and cut to 63 characters.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devinject.discovery.discover import FoundDevice
    from devinject.discovery.host import Host

FEATURE_FILE = "devinject"
NAMESPACE = "devinject.io"
_NOT_LABEL = re.compile(r"[^A-Za-z0-9._-]+")


def label_part(text: str) -> str:
    """`text` as a label name segment or value: invalid runs become `-`, at most 63 characters, alphanumeric
    at both ends."""
    return _NOT_LABEL.sub("-", text)[:63].strip("-._")


def features(host: Host, found: list[FoundDevice], *, out: frozenset[str] = frozenset()) -> list[str]:
    """The feature file's lines for the devices `found` (those whose key is in `out` not counted)."""
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
