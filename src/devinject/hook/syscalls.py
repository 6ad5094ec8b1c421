"""The few syscalls Python 3.11's os module lacks (mount, umount2, setns), through ctypes."""

from __future__ import annotations

import ctypes
import os

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
SIGKILL = 9  # not from `signal`: it imports `enum`, a millisecond on every container start

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, flags: int) -> None:
    _check(libc().mount(source.encode() if source else None, target.encode(), None, ctypes.c_ulong(flags), None),
           f"mount {source or ''} on {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(libc().umount2(target.encode(), flags), f"umount {target}")


def setns(fd: int, nstype: int) -> None:
    native = getattr(os, "setns", None)
    if native is not None:  # Python >= 3.12
        native(fd, nstype)
        return
    _check(libc().setns(fd, nstype), "setns")
