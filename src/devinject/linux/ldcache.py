"""Parser for glibc's /etc/ld.so.cache (the new `glibc-ld.so.cache1.1` format, alone or after the old
`ld.so-1.7.0` table). Strings may be tail-merged (glibc >= 2.33): every string is read NUL-terminated at
its own offset, never assumed separate.
"""

from __future__ import annotations

import struct

from devinject.core.errors import LdCacheError

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

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


# --- writing --------------------------------------------------------------------------------------------
# The hook writes a container's cache itself instead of running `ldconfig -r <rootfs>`: a host binary
# pointed at a rootfs follows the image's links on its own (`/etc -> /proc/1/root/...` reaches the host).

_NEW_FLAGS_LITTLE_ENDIAN = 2
MAX_CACHE_BYTES = 16 << 20


def libcmp_key(name: str) -> tuple[tuple[int, int], ...]:
    """A sort key equal to glibc's `_dl_cache_libcmp`: digit runs compare as numbers and above any other
    character, other characters by code, a prefix first."""
    key: list[tuple[int, int]] = []
    i, size = 0, len(name)
    while i < size:
        if name[i].isdigit() and name[i].isascii():
            j = i
            while j < size and name[j].isdigit() and name[j].isascii():
                j += 1
            key.append((1, int(name[i:j])))
            i = j
        else:
            key.append((0, ord(name[i])))
            i += 1
    return tuple(key)


def merge_entries(existing: list[LdCacheEntry], added: list[LdCacheEntry]) -> list[LdCacheEntry]:
    """`added` on top of `existing`, in the order ld.so's binary search needs: names descending by
    `_dl_cache_libcmp`, then flags descending; for the same name and flags the added entry comes first (and
    ld.so takes the first that fits). glibc-hwcaps entries are dropped: they index an extension table this
    writer does not carry over, and the plain entry for each library remains."""
    replaced = {(e.soname, e.flags) for e in added}
    kept = [e for e in existing if not e.is_hwcaps_subdir and (e.hwcap != 0 or (e.soname, e.flags) not in replaced)]
    merged = list(dict.fromkeys([*added, *kept]))
    merged.sort(key=lambda e: (libcmp_key(e.soname), e.flags), reverse=True)  # stable: added first on ties
    return merged


def build_ldcache(entries: list[LdCacheEntry]) -> bytes:
    """A new-format (`glibc-ld.so.cache1.1`, little-endian) cache with `entries` in the order given."""
    strings = bytearray()
    offsets: dict[str, int] = {}
    table_start = _NEW_HEADER.size + _NEW_ENTRY.size * len(entries)

    def offset_of(text: str) -> int:
        if text not in offsets:
            offsets[text] = table_start + len(strings)
            strings.extend(text.encode() + b"\0")
        return offsets[text]

    body = bytearray()
    for entry in entries:
        value = offset_of(entry.path)
        # The key is usually the path's last component: point into the path string (as ldconfig does).
        key = value + len(entry.path) - len(entry.soname) if entry.path.endswith("/" + entry.soname) \
            else offset_of(entry.soname)
        body += _NEW_ENTRY.pack(entry.flags, key, value, 0, entry.hwcap)
    header = _NEW_HEADER.pack(_NEW_MAGIC, len(entries), len(strings), _NEW_FLAGS_LITTLE_ENDIAN, 0)
    return bytes(header + body + strings)
