"""The identities devinject compares and stores, each built in one place:

- `NodeId` — a device node by its numbers, `c 195:2`: what the ledger books and what device cgroup rules,
  eBPF programs and /proc/<pid>/fd name;
- `DeviceKey` — one physical device, `nvidia.com/gpu=0000:18:00.0`: what health and watch track;
- `QualifiedName` — a CDI device name, `nvidia.com/gpu=0` (parsed and checked by `names`);
- `file_identity` — one version of a file, for caches keyed on it (a changed or replaced file is a new one);
  `path_identity` the same by path.

Each is a plain string at run time (they are stored in JSON); for mypy they are distinct types, so one cannot
be passed where another belongs. Lean: the hook uses this module.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NewType

    from devinject.cdi.model import DeviceNode

    NodeId = NewType("NodeId", str)
    DeviceKey = NewType("DeviceKey", str)
    QualifiedName = NewType("QualifiedName", str)
else:
    NodeId = DeviceKey = QualifiedName = str


def node_id(node_type: str, major: int, minor: int) -> NodeId:
    return NodeId(f"{node_type} {major}:{minor}")


def node_id_of(node: DeviceNode) -> NodeId:
    """A spec or discovered node with its numbers known (char unless the node says block)."""
    assert node.major is not None and node.minor is not None
    return node_id(node.type or "c", node.major, node.minor)


def node_id_of_stat(st: os.stat_result) -> NodeId | None:
    """The identity of a char or block device from stat(); None for anything else."""
    if stat.S_ISCHR(st.st_mode):
        return node_id("c", os.major(st.st_rdev), os.minor(st.st_rdev))
    if stat.S_ISBLK(st.st_mode):
        return node_id("b", os.major(st.st_rdev), os.minor(st.st_rdev))
    return None


def file_identity(st: os.stat_result) -> str:
    """A file's version as stat() sees it: device, inode, size, mtime and ctime. The ctime cannot be set
    back (a `touch -r` or utime() after an edit in place sets it to now), so an edited file never keeps it."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def path_identity(path: str) -> str | None:
    """file_identity of the file at `path` (links followed), None when it cannot be stat'ed: what a follower
    compares to learn that a file another process writes has changed."""
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


def device_key(kind: str, address: str) -> DeviceKey:
    return DeviceKey(f"{kind}={address}")


def qualified(kind: str, name: str) -> QualifiedName:
    return QualifiedName(f"{kind}={name}")
