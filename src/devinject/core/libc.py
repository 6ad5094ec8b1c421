"""The C library through ctypes, loaded once, for the few calls Python 3.11's os module lacks."""

from __future__ import annotations

import ctypes

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc
