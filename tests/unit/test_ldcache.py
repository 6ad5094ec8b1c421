import struct

import pytest

from devinject.core.errors import LdCacheError
from devinject.linux.ldcache import ARCH_X86_64, parse_ldcache
from tests.conftest import HOSTS


def _cache(entries: list[tuple[int, int, int]], strings: bytes, *, old_count: int | None = None) -> bytes:
    """A new-format table (optionally after an old-format one); offsets relative to the new header."""
    header = struct.pack("<20sIIB3xI12x", b"glibc-ld.so.cache1.1", len(entries), len(strings), 2, 0)
    body = b"".join(struct.pack("<iIIIQ", flags, key, value, 0, 0) for flags, key, value in entries)
    new = header + body + strings
    if old_count is None:
        return new
    old = b"ld.so-1.7.0\0" + struct.pack("<I", old_count) + b"\0" * (12 * old_count)
    old += b"\0" * ((-len(old)) % 8)
    return old + new


def test_real_cache_written_by_ldconfig_resolves_sonames():
    data = (HOSTS / "hgx-h100" / "etc" / "ld.so.cache").read_bytes()
    entries = {e.soname: e for e in parse_ldcache(data)}
    assert entries["libcuda.so.1"].path == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert entries["libnvidia-nvvm.so.4"].arch == ARCH_X86_64
    assert entries["libz.so.1"].flags & 0xFF == 3


def test_tail_merged_strings_are_read_at_their_own_offset():
    path = b"/lib/x86_64-linux-gnu/libz3.so.4\0"
    base = 48 + 24  # string table right after one entry
    key = base + len(b"/lib/x86_64-linux-gnu/")  # key points into the middle of the path string
    (entry,) = parse_ldcache(_cache([(0x0303, key, base)], path))
    assert entry.soname == "libz3.so.4"
    assert entry.path == "/lib/x86_64-linux-gnu/libz3.so.4"


def test_compat_format_skips_old_table():
    strings = b"libfoo.so.1\0/usr/lib/libfoo.so.1\0"
    base = 48 + 24
    (entry,) = parse_ldcache(_cache([(0x0303, base, base + 12)], strings, old_count=3))
    assert (entry.soname, entry.path) == ("libfoo.so.1", "/usr/lib/libfoo.so.1")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a cache at all", "no glibc-ld.so.cache1.1"),
        (b"glibc-ld.so.cache1.1" + b"\0" * 4, "truncated header"),
        (struct.pack("<20sIIB3xI12x", b"glibc-ld.so.cache1.1", 100, 0, 2, 0), "truncated"),
        (struct.pack("<20sIIB3xI12x", b"glibc-ld.so.cache1.1", 0, 0, 3, 0), "little-endian"),
    ],
    ids=["garbage", "short-header", "entries-past-end", "big-endian"],
)
def test_bad_caches_are_one_clear_error(data, message):
    with pytest.raises(LdCacheError, match=message):
        parse_ldcache(data)


def test_string_offset_outside_file_is_an_error():
    with pytest.raises(LdCacheError, match="outside the file"):
        parse_ldcache(_cache([(0x0303, 9999, 9999)], b"x\0"))
