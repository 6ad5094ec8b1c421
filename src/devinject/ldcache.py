"""Parser for glibc's /etc/ld.so.cache (the new `glibc-ld.so.cache1.1` format, alone or after the old
`ld.so-1.7.0` table). Strings may be tail-merged (glibc >= 2.33): every string is read NUL-terminated at
its own offset, never assumed separate.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from devinject.errors import LdCacheError

_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, extension_offset
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap
_HWCAP_EXTENSION = 1 << 62

ARCH_X86_64 = 0x0300
ARCH_AARCH64 = 0x0A00
ARCH_PPC64 = 0x0500
FLAG_ELF_LIBC6 = 0x0003


class LdCacheEntry(NamedTuple):
    soname: str
    path: str
    flags: int
    hwcap: int

    @property
    def arch(self) -> int:
        return self.flags & 0xFF00

    @property
    def is_hwcaps_subdir(self) -> bool:
        return (self.hwcap & _HWCAP_EXTENSION) != 0


def parse_ldcache(data: bytes) -> list[LdCacheEntry]:
    base = 0
    if data.startswith(_OLD_MAGIC):
        if len(data) < 16:
            raise LdCacheError("ld.so.cache: truncated old-format header")
        (old_count,) = struct.unpack_from("<I", data, 12)
        base = (16 + 12 * old_count + 7) & ~7
    if data[base : base + len(_NEW_MAGIC)] != _NEW_MAGIC:
        raise LdCacheError("ld.so.cache: no glibc-ld.so.cache1.1 table (old-only or not a cache)")
    if len(data) < base + _NEW_HEADER.size:
        raise LdCacheError("ld.so.cache: truncated header")
    _, count, len_strings, flags, _ = _NEW_HEADER.unpack_from(data, base)
    if flags & 3 not in (0, 2):
        raise LdCacheError("ld.so.cache: not little-endian")
    entries_end = base + _NEW_HEADER.size + _NEW_ENTRY.size * count
    if entries_end + len_strings > len(data):
        raise LdCacheError(f"ld.so.cache: truncated: {count} entries and their strings do not fit in {len(data)} bytes")
    entries = []
    for index in range(count):
        e_flags, key, value, _, hwcap = _NEW_ENTRY.unpack_from(data, base + _NEW_HEADER.size + 24 * index)
        entries.append(LdCacheEntry(_cstr(data, base + key), _cstr(data, base + value), e_flags, hwcap))
    return entries


def _cstr(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if offset >= len(data) or end < 0:
        raise LdCacheError(f"ld.so.cache: string offset {offset} outside the file")
    return data[offset:end].decode("utf-8", "replace")
