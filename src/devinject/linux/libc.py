"""The C library, for the few calls Python 3.11's os module lacks (mount, setns, statx, syscall, prctl):
the standard library's `ctypes`, imported when first used.

Not at import time: the hook imports this module on every container start it runs in-process, and the ctypes
package (its type zoo, `struct`, `types`) costs ~1 ms there. The hook installs a backend of its own that
reaches the same C functions through CPython's private `_ctypes` (hook/fastlibc.py, `install`), measured by
bench/bench_hook_imports.py; nothing else does. A call's arguments are Python ints (passed as C int), bytes or
None (a const pointer), `Long(n)` (a C long: every argument of the variadic syscall(), and 64-bit values) or a
`buffer()` (a writable one). Every function returns a C long; its errno is `errno()`.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ctypes
    from collections.abc import Callable
    from typing import Protocol

    Array = ctypes.Array[ctypes.c_char]

    class Backend(Protocol):
        def function(self, name: str) -> Callable[..., int]: ...
        def long(self, value: int) -> ctypes.c_long: ...
        def buffer(self, size: int) -> Array: ...
        def errno(self) -> int: ...
        def addressof(self, array: Array) -> int: ...


class _Ctypes:
    """The ctypes package's: this process's own symbols, the C library's among them (`CDLL(None)`), each
    function returning a C long and keeping its errno."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self._process = ctypes.CDLL(None, use_errno=True)
        self._prototype = ctypes.CFUNCTYPE(ctypes.c_long, use_errno=True)  # every function's: C long, errno kept

    def function(self, name: str) -> Callable[..., int]:
        found: Callable[..., int] = self._prototype((name, self._process))
        return found

    def long(self, value: int) -> ctypes.c_long:
        return self._ctypes.c_long(value)

    def buffer(self, size: int) -> Array:
        return (self._ctypes.c_char * size)()

    def errno(self) -> int:
        return self._ctypes.get_errno()

    def addressof(self, array: Array) -> int:
        return self._ctypes.addressof(array)


_backend: Backend | None = None
_functions: dict[str, Callable[..., int]] = {}


def _current() -> Backend:
    global _backend
    if _backend is None:
        _backend = _Ctypes()
    return _backend


def install(backend: Backend) -> None:
    """Use another backend from now on, in this process (the hook's import-free one); the functions already
    looked up stay when it is the one in use."""
    global _backend
    if backend is not _backend:
        _backend = backend
        _functions.clear()


def function(name: str) -> Callable[..., int]:
    """The C library's `name`; AttributeError when it has none (an older C library)."""
    found = _functions.get(name)
    if found is None:
        found = _functions[name] = _current().function(name)
    return found


def Long(value: int) -> ctypes.c_long:  # reads as the C type it makes, as ctypes.c_long does
    """`value` as a C long argument."""
    return _current().long(value)


def buffer(size: int, data: bytes = b"") -> Array:
    """A writable, zeroed char array of `size` bytes starting with `data` (its bytes are `.raw`)."""
    array = _current().buffer(size)
    if data:
        array.raw = data
    return array


def errno() -> int:
    return _current().errno()


def addressof(array: Array) -> int:
    return _current().addressof(array)
