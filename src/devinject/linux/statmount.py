"""Which mount a file is on and what that mount is, asked of the kernel for one file (statx's mount id,
statmount) rather than read from the mount table: read only, through linux/libc.py. The hook's executor
(shared mounts) and the device cgroup lookup (linux/devcgroup.py) use it; `syscall` is the syscall(2) call
the hook's mount syscalls share."""

from __future__ import annotations

import os
import sys

from devinject.linux import libc


def syscall(number: int, *args: int | bytes | libc.Array, what: str) -> int:
    """syscall(2), which takes every argument as a long (ints are widened here), raising OSError."""
    result = libc.function("syscall")(libc.Long(number), *(libc.Long(a) if isinstance(a, int) else a for a in args))
    if result < 0:
        err = libc.errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


# --- statx and statmount: which mount a file is on, and how that mount propagates -----------------------
AT_EMPTY_PATH = 0x1000
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
        syscall(_SYS_STATMOUNT, request, buffer, size, 0, what="statmount")
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
