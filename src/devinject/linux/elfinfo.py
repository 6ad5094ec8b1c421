"""The two facts the linker cache needs from a shared library: its SONAME and its cache flags (ELF class
and machine). Reads through an fd with bounded preads: the file may come from a hostile image."""

from __future__ import annotations

import posix  # not `os`, ~0.9 ms of imports: the hook runs this on every container start
import struct

from devinject.linux.ldcache import ARCH_AARCH64, ARCH_PPC64, ARCH_X86_64, FLAG_ELF_LIBC6

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

_ET_DYN = 3
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_STRTAB, _DT_SONAME = 0, 5, 14
MAX_PROGRAM_HEADERS = 128
MAX_DYNAMIC_ENTRIES = 4096
MAX_SONAME = 1024
# (ELF class, e_machine) -> ldconfig's arch flag (sysdeps/generic/ldconfig.h)
_ARCH = {(2, 62): ARCH_X86_64, (1, 3): 0x0000, (1, 62): 0x0800, (2, 183): ARCH_AARCH64, (2, 21): ARCH_PPC64,
         (2, 22): 0x0400}


class SharedObject(NamedTuple):
    soname: str
    flags: int


def read_shared_object(fd: int) -> SharedObject | None:
    """SONAME and cache flags of the ELF shared object open at `fd`; None for anything else (not ELF, not a
    shared object, no SONAME, an architecture the cache has no flag for, or a malformed file)."""
    try:
        return _read(fd)
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None


class _Layout(NamedTuple):
    """Where an ELF class (1: 32-bit, 2: 64-bit) keeps what the cache needs: e_phoff's format and offset, the
    offset of e_phentsize and e_phnum, a program header with the places of p_type, p_offset, p_vaddr and
    p_filesz in it, and a dynamic entry (tag, value)."""

    phoff: str
    phoff_at: int
    phsizes_at: int
    ph: struct.Struct
    ph_fields: tuple[int, int, int, int]
    dyn: struct.Struct


_LAYOUTS = {2: _Layout("<Q", 32, 54, struct.Struct("<IIQQQQQQ"), (0, 2, 3, 5), struct.Struct("<qQ")),
            1: _Layout("<I", 28, 42, struct.Struct("<IIIIIIII"), (0, 1, 2, 4), struct.Struct("<iI"))}


def _read(fd: int) -> SharedObject | None:
    ident = posix.pread(fd, 64, 0)
    if len(ident) < 52 or ident[:4] != b"\x7fELF" or ident[5] != 1:  # little-endian only
        return None
    layout = _LAYOUTS.get(ident[4])
    if layout is None:
        return None
    e_type, machine = struct.unpack_from("<HH", ident, 16)
    (phoff,) = struct.unpack_from(layout.phoff, ident, layout.phoff_at)
    phentsize, phnum = struct.unpack_from("<HH", ident, layout.phsizes_at)
    arch = _ARCH.get((ident[4], machine))
    if e_type != _ET_DYN or arch is None or phentsize < layout.ph.size or not 0 < phnum <= MAX_PROGRAM_HEADERS:
        return None
    segments = _segments(posix.pread(fd, phentsize * phnum, phoff), layout, phentsize, phnum)
    if segments is None:
        return None
    loads, (dynamic_offset, dynamic_size) = segments
    dyn = layout.dyn
    tags = _strtab_and_soname(posix.pread(fd, min(dynamic_size, dyn.size * MAX_DYNAMIC_ENTRIES), dynamic_offset), dyn)
    if tags is None:
        return None
    name = _string_at(fd, loads, *tags)
    if not name or "/" in name:
        return None
    return SharedObject(name, arch | FLAG_ELF_LIBC6)


def _segments(table: bytes, layout: _Layout, phentsize: int,
              phnum: int) -> tuple[list[tuple[int, int, int]], tuple[int, int]] | None:
    """The loaded segments (vaddr, filesz, offset) and the dynamic one (offset, filesz) of a program header
    table; None without a dynamic segment or for a table cut short."""
    loads: list[tuple[int, int, int]] = []
    dynamic: tuple[int, int] | None = None
    type_at, offset_at, vaddr_at, filesz_at = layout.ph_fields
    for index in range(phnum):
        if len(table) < (index + 1) * phentsize:
            return None
        fields = layout.ph.unpack_from(table, index * phentsize)
        if fields[type_at] == _PT_LOAD:
            loads.append((fields[vaddr_at], fields[filesz_at], fields[offset_at]))
        elif fields[type_at] == _PT_DYNAMIC:
            dynamic = (fields[offset_at], fields[filesz_at])
    return None if dynamic is None else (loads, dynamic)


def _strtab_and_soname(data: bytes, dyn: struct.Struct) -> tuple[int, int] | None:
    """DT_STRTAB's address and DT_SONAME's offset in it, from the dynamic section up to DT_NULL."""
    strtab = soname = None
    for index in range(len(data) // dyn.size):
        tag, value = dyn.unpack_from(data, index * dyn.size)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = value
        elif tag == _DT_SONAME:
            soname = value
    return None if strtab is None or soname is None else (strtab, soname)


def _string_at(fd: int, loads: list[tuple[int, int, int]], strtab: int, offset: int) -> str | None:
    """The string at `offset` in the string table at address `strtab`, read where a loaded segment puts that
    address in the file; None where none does."""
    for vaddr, filesz, file_offset in loads:
        if vaddr <= strtab < vaddr + filesz:
            raw = posix.pread(fd, MAX_SONAME, file_offset + strtab - vaddr + offset)
            end = raw.find(b"\0")
            return raw[:end].decode() if end > 0 else ""
    return None
