"""linux/libc.py: the C library through the standard library's ctypes, or through the hook's backend
(hook/fastlibc.py: `_ctypes`, without the ctypes package); both give the same answers."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

import pytest

from devinject.hook import fastlibc
from devinject.linux import libc

SYS_GETPID_X86_64 = 39


@pytest.fixture(params=["ctypes", "fastlibc"], autouse=True)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    before = libc._backend
    if request.param == "fastlibc":
        fastlibc.install()
    else:
        libc.install(libc._Ctypes())
    yield request.param
    libc._backend = before
    libc._functions.clear()


def test_calls_return_c_longs_and_keep_errno() -> None:
    assert libc.function("setns")(-1, 0) == -1
    assert libc.errno() == errno.EBADF
    if os.uname().machine == "x86_64":
        assert libc.function("syscall")(libc.Long(SYS_GETPID_X86_64)) == os.getpid()
    # a 64-bit argument arrives whole: lseek to an offset past 4 GiB on a fresh file reports it back
    fd = os.memfd_create("libc-test")
    try:
        assert libc.function("lseek")(fd, libc.Long(5 << 32), 0) == 5 << 32
    finally:
        os.close(fd)


def test_buffers_are_writable_zeroed_and_start_with_their_data() -> None:
    buffer = libc.buffer(8, b"abc")
    assert buffer.raw == b"abc\0\0\0\0\0"
    assert libc.function("snprintf")(buffer, 8, b"%d", 12345) == 5
    assert buffer.value == b"12345"
    assert libc.addressof(buffer) != libc.addressof(libc.buffer(8))


def test_a_missing_function_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        libc.function("no_such_function_in_any_libc")


def test_the_backend_in_use_makes_the_calls(backend: str) -> None:
    made = type(libc.Long(1)).__module__
    assert (made == "ctypes") == (backend == "ctypes"), made

