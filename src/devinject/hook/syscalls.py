"""The mount and namespace syscalls Python 3.11's os module lacks (mount, umount2, setns, the new mount API,
statx's mount id, statmount), through core/libc.py."""

from __future__ import annotations

import os
import sys

from devinject.core import libc
from devinject.core.libc import Long

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
    _check(libc.function("mount")(source.encode() if source else None, target.encode(), None, Long(flags), None),
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
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MS_PRIVATE = 1 << 18


def _syscall(number: int, *args: int | bytes | libc.Array, what: str) -> int:
    """syscall(2), which takes every argument as a long (ints are widened here), raising OSError."""
    result = libc.function("syscall")(Long(number), *(Long(a) if isinstance(a, int) else a for a in args))
    if result < 0:
        err = libc.errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


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


# --- statx and statmount: which mount a file is on, and how that mount propagates -----------------------
STATX_MNT_ID = 0x1000  # Linux >= 5.8: the id /proc/self/mountinfo shows
STATX_MNT_ID_UNIQUE = 0x4000  # Linux >= 6.8: the 64-bit id statmount takes
_STATX_SIZE = 256
_STATX_MNT_ID_OFFSET = 144  # struct statx: after mask .. dev_minor (include/uapi/linux/stat.h)
_SYS_STATMOUNT = 457
STATMOUNT_SB_BASIC = 0x1
STATMOUNT_MNT_BASIC = 0x2
STATMOUNT_MNT_ROOT = 0x8
MNT_ID_REQ_SIZE_VER0 = 24  # struct mnt_id_req: size, spare, mnt_id, param (the mask)
_STATMOUNT_SIZE = 512  # struct statmount, its strings follow
_STATMOUNT_MASK_OFFSET = 8
_STATMOUNT_MAGIC_OFFSET = 24  # sb_magic
_STATMOUNT_ROOT_OFFSET = 104  # mnt_root: where its string starts, after the struct
_STATMOUNT_PROPAGATION_OFFSET = 72  # struct statmount: mnt_propagation (include/uapi/linux/mount.h)
MS_SHARED = 1 << 20


def mount_id(fd: int, *, unique: bool = False) -> int | None:
    """The id of the mount `fd` is on (as /proc/self/mountinfo numbers it, or `unique`: the one statmount
    takes), in one statx call; None where the kernel or the C library cannot tell."""
    wanted = STATX_MNT_ID_UNIQUE if unique else STATX_MNT_ID
    buffer = libc.buffer(_STATX_SIZE)
    try:
        result = libc.function("statx")(fd, b"", AT_EMPTY_PATH, wanted, buffer)
    except AttributeError:  # a C library without the wrapper
        return None
    if result != 0 or not int.from_bytes(buffer.raw[0:4], sys.byteorder) & wanted:
        return None
    return int.from_bytes(buffer.raw[_STATX_MNT_ID_OFFSET:_STATX_MNT_ID_OFFSET + 8], sys.byteorder)


def _statmount(fd: int, mask: int, size: int = _STATMOUNT_SIZE) -> bytes | None:
    """struct statmount (and its strings) for the mount `fd` is on, with every part of `mask` filled in;
    None where the kernel cannot tell (Linux < 6.8)."""
    unique = mount_id(fd, unique=True)
    if unique is None:
        return None
    order = sys.byteorder
    request = (MNT_ID_REQ_SIZE_VER0.to_bytes(4, order) + bytes(4) + unique.to_bytes(8, order)
               + mask.to_bytes(8, order))
    buffer = libc.buffer(size)
    try:
        _syscall(_SYS_STATMOUNT, request, buffer, size, 0, what="statmount")
    except OSError:
        return None
    raw = buffer.raw
    filled = int.from_bytes(raw[_STATMOUNT_MASK_OFFSET:_STATMOUNT_MASK_OFFSET + 8], order)
    return raw if filled & mask == mask else None


def mount_propagation(fd: int) -> int | None:
    """The propagation flags (MS_SHARED, MS_SLAVE, ...) of the mount `fd` is on, from statmount (Linux >=
    6.8) in this process's mount namespace; None where the kernel cannot tell (the caller reads
    /proc/self/mountinfo then, whose size grows with every mount on the node)."""
    raw = _statmount(fd, STATMOUNT_MNT_BASIC)
    if raw is None:
        return None
    return int.from_bytes(raw[_STATMOUNT_PROPAGATION_OFFSET:_STATMOUNT_PROPAGATION_OFFSET + 8], sys.byteorder)


def mount_magic_and_root(fd: int) -> tuple[int, str] | None:
    """The filesystem magic (CGROUP2_SUPER_MAGIC, ...) of the mount `fd` is on and the mount's root within
    that filesystem (as mountinfo's fourth field), from statmount; None where the kernel cannot tell."""
    raw = _statmount(fd, STATMOUNT_SB_BASIC | STATMOUNT_MNT_ROOT, _STATMOUNT_SIZE + 4096)
    if raw is None:
        return None
    magic = int.from_bytes(raw[_STATMOUNT_MAGIC_OFFSET:_STATMOUNT_MAGIC_OFFSET + 8], sys.byteorder)
    offset = _STATMOUNT_SIZE + int.from_bytes(raw[_STATMOUNT_ROOT_OFFSET:_STATMOUNT_ROOT_OFFSET + 4], sys.byteorder)
    end = raw.find(b"\0", offset)
    if end < 0:
        return None  # not terminated within the buffer: the kernel would have said EOVERFLOW; never guess
    return magic, raw[offset:end].decode("utf-8", "surrogateescape")
