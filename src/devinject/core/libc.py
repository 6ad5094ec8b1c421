"""The C library through ctypes, loaded once, for the few calls Python 3.11's os module lacks."""

from __future__ import annotations

import ctypes
import os

RENAME_EXCHANGE = 2

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def rename_exchange(dir_fd: int, first: str, second: str) -> None:
    """Swap the names `first` and `second` in the directory `dir_fd` atomically (renameat2
    RENAME_EXCHANGE, Linux >= 3.15). OSError (ENOSYS without the call, EINVAL where a filesystem cannot)."""
    try:
        renameat2 = libc().renameat2
    except AttributeError:  # a C library without the wrapper
        raise OSError(38, os.strerror(38)) from None  # ENOSYS
    if renameat2(dir_fd, first.encode(), dir_fd, second.encode(), ctypes.c_uint(RENAME_EXCHANGE)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), first, None, second)
