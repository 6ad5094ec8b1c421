"""The C library, for the few calls Python 3.11's os module lacks (mount, setns, statx, syscall, prctl).

Through `_ctypes`, what the ctypes package wraps: the package itself (its type zoo, `struct`, `types`) costs
~1 ms of imports on each container start the hook serves in-process, as `signal` and `socket` would (the
hook uses `_signal` and `_socket` for the same reason). The few types needed are declared here, as ctypes
declares them. A call's arguments are Python ints (passed as C int), bytes or None (a const pointer),
`Long(n)` (a C long: every argument of the variadic syscall(), and 64-bit values) or a `buffer()` (a
writable one). Every function returns a C long; its errno is `errno()`.
"""

from __future__ import annotations

import _ctypes

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
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


_functions: dict[str, Callable[..., int]] = {}


def function(name: str) -> Callable[..., int]:
    """The C library's `name`; AttributeError when it has none (an older C library)."""
    found = _functions.get(name)
    if found is None:
        if not _Process._handle:
            _Process._handle = _ctypes.dlopen(None, _RTLD_NOW)  # type: ignore[arg-type]
        found = _functions[name] = _Function((name, _Process))  # type: ignore[arg-type]
    return found


if TYPE_CHECKING:
    Array = _ctypes.Array[Char]


def buffer(size: int, data: bytes = b"") -> Array:
    """A writable, zeroed char array of `size` bytes starting with `data` (its bytes are `.raw`)."""
    array: Array = (Char * size)()
    if data:
        array.raw = data
    return array


def errno() -> int:
    return _ctypes.get_errno()


def addressof(array: Array) -> int:
    return _ctypes.addressof(array)
