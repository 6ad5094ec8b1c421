"""core/libc.py: the C library through `_ctypes`, without the ctypes package."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

from devinject.core import libc

SYS_GETPID_X86_64 = 39


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
    try:
        libc.function("no_such_function_in_any_libc")
    except AttributeError:
        return
    raise AssertionError("no AttributeError")


def test_it_does_not_import_the_ctypes_package() -> None:
    code = "import sys\nfrom devinject.core import libc\nlibc.function('getpid')\nprint('ctypes' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "src")})
    assert done.stdout.strip() == "False", done.stderr
