"""The two facts the linker cache needs from a shared library: its SONAME and its cache flags (ELF class
and machine). Reads through an fd with bounded preads: the file may come from a hostile image."""

from __future__ import annotations

import os
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


def _read(fd: int) -> SharedObject | None:
    ident = os.pread(fd, 64, 0)
    if len(ident) < 52 or ident[:4] != b"\x7fELF" or ident[5] != 1:  # little-endian only
        return None
    elf_class = ident[4]
    if elf_class == 2:
        e_type, machine = struct.unpack_from("<HH", ident, 16)
        (phoff,) = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
        ph, dyn = struct.Struct("<IIQQQQQQ"), struct.Struct("<qQ")
    elif elf_class == 1:
        e_type, machine = struct.unpack_from("<HH", ident, 16)
        (phoff,) = struct.unpack_from("<I", ident, 28)
        phentsize, phnum = struct.unpack_from("<HH", ident, 42)
        ph, dyn = struct.Struct("<IIIIIIII"), struct.Struct("<iI")
    else:
        return None
    arch = _ARCH.get((elf_class, machine))
    if e_type != _ET_DYN or arch is None or phentsize < ph.size or not 0 < phnum <= MAX_PROGRAM_HEADERS:
        return None
    table = os.pread(fd, phentsize * phnum, phoff)
    loads: list[tuple[int, int, int]] = []  # (vaddr, filesz, offset)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for index in range(phnum):
        if len(table) < (index + 1) * phentsize:
            return None
        fields = ph.unpack_from(table, index * phentsize)
        if elf_class == 2:
            p_type, _, offset, vaddr, _, filesz = fields[:6]
        else:
            p_type, offset, vaddr, _, filesz = fields[:5]
        if p_type == _PT_LOAD:
            loads.append((vaddr, filesz, offset))
        elif p_type == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        return None
    data = os.pread(fd, min(dynamic[1], dyn.size * MAX_DYNAMIC_ENTRIES), dynamic[0])
    strtab = soname = None
    for index in range(len(data) // dyn.size):
        tag, value = dyn.unpack_from(data, index * dyn.size)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = value
        elif tag == _DT_SONAME:
            soname = value
    if strtab is None or soname is None:
        return None
    for vaddr, filesz, offset in loads:  # the string table's address -> its place in the file
        if vaddr <= strtab < vaddr + filesz:
            raw = os.pread(fd, MAX_SONAME, offset + strtab - vaddr + soname)
            end = raw.find(b"\0")
            name = raw[:end].decode() if end > 0 else ""
            if not name or "/" in name:
                return None
            return SharedObject(name, arch | FLAG_ELF_LIBC6)
    return None
