"""The mount and namespace syscalls Python 3.11's os module lacks (mount, umount2, setns, the new mount API),
through linux/libc.py; which mount a file is on (statx's mount id, statmount) is linux/statmount.py's."""

from __future__ import annotations

import os
import sys

from devinject.linux import libc

# Which mount a file is on (statx, statmount): read-only, shared with the device cgroup lookup.
from devinject.linux.statmount import AT_EMPTY_PATH
from devinject.linux.statmount import MS_SHARED as MS_SHARED
from devinject.linux.statmount import mount_id as mount_id
from devinject.linux.statmount import mount_propagation as mount_propagation
from devinject.linux.statmount import syscall as _syscall

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
SIGKILL = 9  # not from `signal`: it imports `enum`, a millisecond on every container start

def _check(result: int, what: str) -> None:
    if result != 0:
        err = libc.errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, flags: int) -> None:
    _check(libc.function("mount")(source.encode() if source else None, target.encode(), None, libc.Long(flags), None),
           f"mount {source or ''} on {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(libc.function("umount2")(target.encode(), flags), f"umount {target}")


def setns(fd: int, nstype: int) -> None:
    native = getattr(os, "setns", None)
    if native is not None:  # Python >= 3.12
        native(fd, nstype)
        return
    _check(libc.function("setns")(fd, nstype), "setns")


# --- the new mount API (Linux >= 5.2, mount_setattr >= 5.12) --------------------------------------------
# Syscall numbers from 424 on are the same on every architecture.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MS_PRIVATE = 1 << 18


def open_tree_clone(path: str, *, recursive: bool = False) -> int:
    """A detached copy of the mount at `path` (a bind mount not yet attached anywhere); close-on-exec."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    return _syscall(_SYS_OPEN_TREE, AT_FDCWD, path.encode(), flags, what=f"open_tree {path}")


def mount_setattr(tree_fd: int, attr_set: int, *, private: bool = True, recursive: bool = False) -> None:
    # struct mount_attr: attr_set, attr_clr, propagation, userns_fd (4 x u64)
    attr = b"".join(v.to_bytes(8, sys.byteorder) for v in (attr_set, 0, MS_PRIVATE if private else 0, 0))
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _syscall(_SYS_MOUNT_SETATTR, tree_fd, b"", flags, attr, len(attr), what="mount_setattr")


def move_mount(tree_fd: int, target_fd: int) -> None:
    """Attach the detached mount `tree_fd` on the object `target_fd` refers to (no path is resolved)."""
    _syscall(_SYS_MOVE_MOUNT, tree_fd, b"", target_fd, b"", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
             what="move_mount")
