"""The hook's way to the C library: CPython's `_ctypes`, the C module the ctypes package wraps, without the
package.

The package (its type zoo, `struct`, `types`) costs ~1 ms of every container start the hook runs in-process
(bench/bench_hook_imports.py), as `signal` and `socket` would (the hook uses `_signal` and `_socket` for the
same reason). The few types needed are declared here, as ctypes declares them. This is private CPython API,
so it is kept here, in the hook, and nowhere else: `install()` puts it behind linux/libc.py for this process.
"""

from __future__ import annotations

import _ctypes

from devinject.linux import libc

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ctypes
    from collections.abc import Callable

    Char = ctypes.c_char
    Long = ctypes.c_long
else:

    class Char(_ctypes._SimpleCData):  # ctypes.c_char
        _type_ = "c"

    class Long(_ctypes._SimpleCData):  # ctypes.c_long
        _type_ = "l"

_RTLD_NOW = 2


class _Function(_ctypes.CFuncPtr):
    """A C function returning long that keeps its errno (ctypes.CDLL(None, use_errno=True)'s functions)."""

    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = Long


class _Process:
    """This process's own symbols, the C library's among them (ctypes.CDLL(None))."""

    _handle: int = 0


class Backend:
    """linux/libc.py's backend (libc.Backend) on `_ctypes`."""

    def function(self, name: str) -> Callable[..., int]:
        if not _Process._handle:
            _Process._handle = _ctypes.dlopen(None, _RTLD_NOW)  # type: ignore[arg-type]
        return _Function((name, _Process))  # type: ignore[arg-type]

    def long(self, value: int) -> Long:
        return Long(value)

    def buffer(self, size: int) -> libc.Array:
        return (Char * size)()

    def errno(self) -> int:
        return _ctypes.get_errno()

    def addressof(self, array: libc.Array) -> int:
        return _ctypes.addressof(array)


_BACKEND = Backend()


def install() -> None:
    libc.install(_BACKEND)
