"""read_shared_object on hand-built ELF files of both classes: the 32-bit layout (i386 libraries in a
multiarch image) has no compiler here to build it, so its header, program headers and dynamic section are
written byte by byte, the same way for the 64-bit one as a check of the builder."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from devinject.linux.elfinfo import read_shared_object
from devinject.linux.ldcache import ARCH_X86_64, FLAG_ELF_LIBC6

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_STRTAB, _DT_SONAME = 0, 5, 14
BASE = 0x1000  # the address the one loaded segment maps the file's first byte to


def shared_object(elf_class: int, machine: int, soname: bytes, *, e_type: int = 3) -> bytes:
    """A little-endian ELF shared object: one PT_LOAD mapping the whole file, a PT_DYNAMIC with DT_STRTAB,
    DT_SONAME and DT_NULL, and the string table holding `soname`."""
    wide = elf_class == 2
    header_size, ph_size = (64, 56) if wide else (52, 32)
    strings = b"\0" + soname + b"\0"
    strtab_at = header_size + 2 * ph_size
    dynamic_at = (strtab_at + len(strings) + 7) // 8 * 8
    entry = struct.Struct("<qQ" if wide else "<iI")
    dynamic = b"".join(entry.pack(tag, value) for tag, value in ((_DT_STRTAB, BASE + strtab_at), (_DT_SONAME, 1),
                                                                 (_DT_NULL, 0)))
    size = dynamic_at + len(dynamic)
    ident = b"\x7fELF" + bytes([elf_class, 1, 1]) + bytes(9)
    if wide:
        header = struct.pack("<16sHHIQQQIHHHHHH", ident, e_type, machine, 1, 0, header_size, 0, 0, header_size,
                             ph_size, 2, 64, 0, 0)
        phs = (struct.pack("<IIQQQQQQ", _PT_LOAD, 5, 0, BASE, BASE, size, size, 0x1000)
               + struct.pack("<IIQQQQQQ", _PT_DYNAMIC, 6, dynamic_at, BASE + dynamic_at, BASE + dynamic_at,
                             len(dynamic), len(dynamic), 8))
    else:
        header = struct.pack("<16sHHIIIIIHHHHHH", ident, e_type, machine, 1, 0, header_size, 0, 0, header_size,
                             ph_size, 2, 40, 0, 0)
        phs = (struct.pack("<IIIIIIII", _PT_LOAD, 0, BASE, BASE, size, size, 5, 0x1000)
               + struct.pack("<IIIIIIII", _PT_DYNAMIC, dynamic_at, BASE + dynamic_at, BASE + dynamic_at,
                             len(dynamic), len(dynamic), 6, 4))
    body = header + phs + strings
    return body + bytes(dynamic_at - len(body)) + dynamic


def read(tmp_path: Path, data: bytes) -> object:
    path = tmp_path / "lib.so"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_shared_object(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("elf_class", "machine", "flags"), [(2, 62, ARCH_X86_64 | FLAG_ELF_LIBC6),
                                                              (1, 3, FLAG_ELF_LIBC6)], ids=["x86_64", "i386"])
def test_both_elf_classes_give_their_soname_and_cache_flags(tmp_path: Path, elf_class: int, machine: int,
                                                           flags: int) -> None:
    found = read(tmp_path, shared_object(elf_class, machine, b"libcuda.so.1"))
    assert found is not None and (found.soname, found.flags) == ("libcuda.so.1", flags)


@pytest.mark.parametrize("elf_class", [1, 2])
def test_what_is_no_shared_object_with_a_plain_soname_gives_none(tmp_path: Path, elf_class: int) -> None:
    machine = 3 if elf_class == 1 else 62
    assert read(tmp_path, shared_object(elf_class, machine, b"../libevil.so")) is None  # a path, not a name
    assert read(tmp_path, shared_object(elf_class, machine, b"")) is None
    assert read(tmp_path, shared_object(elf_class, machine, b"libx.so", e_type=2)) is None  # an executable
    assert read(tmp_path, shared_object(elf_class, 99, b"libx.so")) is None  # no cache flag for the machine
    whole = shared_object(elf_class, machine, b"libx.so")
    assert read(tmp_path, whole[:100]) is None  # cut inside its program headers
    assert read(tmp_path, whole[:4] + bytes([3]) + whole[5:]) is None  # no ELF class 3
