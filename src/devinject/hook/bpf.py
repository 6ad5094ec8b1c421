"""cgroup v2 device access: prepend allow rules to the container's BPF_CGROUP_DEVICE program.

The instruction encoder is pure (tested byte for byte). Our prefix starts with a marker so a second run for
the same container replaces it instead of stacking another. What only reads (the bpf(2) call, the program
query, the prefix's format and its decoding) is linux/devprogram.py's; this module writes programs: it
loads, attaches and swaps them back.
"""

from __future__ import annotations

import os
import resource
import struct

from devinject.core.errors import HookError
from devinject.linux import libc
from devinject.linux.devprogram import (
    ACCESS_BITS,
    BPF_CGROUP_DEVICE,
    DEV_TYPES,
    MARKER,
    bpf_attr,
    bpf_call,
    decode_rules,
    insn,
    mov_imm,
    program_fd,
    program_instructions,
    query_programs,
)

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple

    from devinject.linux.devcgroup import AllowDevice
else:
    from devinject.core.records import NamedTuple


# bpf(2) commands, program type, flags (include/uapi/linux/bpf.h) for writing a program
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4


def _ldx_w(dst: int, src: int, off: int) -> bytes:
    return insn(0x61, dst, src, off)  # BPF_LDX | BPF_W | BPF_MEM


def _jne_imm(dst: int, imm: int, off: int) -> bytes:
    return insn(0x55, dst, off=off, imm=imm)  # BPF_JMP | BPF_JNE | BPF_K


def encode_prefix(rules: tuple[AllowDevice, ...]) -> bytes:
    """Instructions that return 1 (allow) for any of `rules`, else fall through to what follows."""
    out = [
        mov_imm(0, MARKER),
        mov_imm(0, len(rules)),  # rule count: lets the next run find where the original program starts
        _ldx_w(2, 1, 0),  # r2 = access_type
        insn(0xBF, 3, 2),  # r3 = r2
        insn(0x54, 2, imm=0xFFFF),  # w2 &= 0xffff  -> device type
        insn(0x77, 3, imm=16),  # r3 >>= 16      -> requested access
        _ldx_w(4, 1, 4),  # r4 = major
        _ldx_w(5, 1, 8),  # r5 = minor
    ]
    for rule in rules:
        allowed = sum(ACCESS_BITS[ch] for ch in rule.access)
        out += [
            _jne_imm(2, DEV_TYPES[rule.type], 7),
            insn(0xBF, 6, 3),  # r6 = access
            insn(0x54, 6, imm=~allowed & 0xFFFF),  # bits asked for but not granted
            _jne_imm(6, 0, 4),
            _jne_imm(4, rule.major, 3),
            _jne_imm(5, rule.minor, 2),
            mov_imm(0, 1),
            insn(0x95),  # exit
        ]
    return b"".join(out)


# --- the bpf(2) edge --------------------------------------------------------------------------------


def _load(program: bytes) -> int:
    code = libc.buffer(len(program), program)
    license_ = libc.buffer(len(b"Apache") + 1, b"Apache")
    log = libc.buffer(65536)
    attr = bpf_attr(("<I", 0, BPF_PROG_TYPE_CGROUP_DEVICE), ("<I", 4, len(program) // 8),
                 ("<Q", 8, libc.addressof(code)), ("<Q", 16, libc.addressof(license_)),
                 ("<I", 24, 1), ("<I", 28, len(log)), ("<Q", 32, libc.addressof(log)),
                 ("<I", 68, BPF_CGROUP_DEVICE))
    struct.pack_into("16s", attr, 48, b"devinject")
    try:
        return bpf_call(BPF_PROG_LOAD, attr)
    except OSError as err:
        detail = log.value.decode(errors="replace").strip().splitlines()
        raise HookError(f"cgroup v2: loading the device program failed: {err.strerror}"
                        f"{': ' + detail[-1] if detail else ''}") from None


def _replace(cgroup_fd: int, new_fd: int, old_fd: int, flags: int) -> None:
    if flags & BPF_F_ALLOW_MULTI:
        bpf_call(BPF_PROG_ATTACH, bpf_attr(("<I", 0, cgroup_fd), ("<I", 4, new_fd), ("<I", 8, BPF_CGROUP_DEVICE),
                                    ("<I", 12, BPF_F_ALLOW_MULTI | BPF_F_REPLACE), ("<I", 16, old_fd)))
    else:  # a single non-multi program: attaching another replaces it
        bpf_call(BPF_PROG_ATTACH, bpf_attr(("<I", 0, cgroup_fd), ("<I", 4, new_fd), ("<I", 8, BPF_CGROUP_DEVICE),
                                    ("<I", 12, flags)))


class Swap(NamedTuple):
    cgroup_fd: int
    old_fd: int
    new_fd: int
    flags: int


def allow_devices(cgroup_path: str, rules: tuple[AllowDevice, ...]) -> Swap | None:
    """Swap the cgroup's device program for one that also allows `rules`. None: nothing was restricted."""
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass  # kernels >= 5.11 account BPF memory to the cgroup instead
    try:
        cgroup_fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise HookError(f"{cgroup_path}: cannot open the container's cgroup: {err.strerror}") from None
    try:
        prog_ids, flags = query_programs(cgroup_fd)
        if not prog_ids:
            os.close(cgroup_fd)
            return None  # no device program: the cgroup does not restrict devices
        if len(prog_ids) > 1:
            raise HookError(f"{cgroup_path}: {len(prog_ids)} device programs attached; expected the runtime's one")
        old_fd = program_fd(prog_ids[0])
        previous, original = decode_rules(program_instructions(old_fd))
        merged = tuple(dict.fromkeys(previous + rules))
        new_fd = _load(encode_prefix(merged) + original)
        _replace(cgroup_fd, new_fd, old_fd, flags)
        return Swap(cgroup_fd, old_fd, new_fd, flags)
    except OSError as err:
        os.close(cgroup_fd)
        raise HookError(f"{cgroup_path}: cgroup v2 device program: {err.strerror}") from None


def restore(swap: object) -> None:
    if isinstance(swap, Swap):
        try:
            _replace(swap.cgroup_fd, swap.old_fd, swap.new_fd, swap.flags)
        except OSError:
            pass  # best effort: the rest of the rollback still runs
        release(swap)


def release(swap: object) -> None:
    if isinstance(swap, Swap):
        for fd in (swap.cgroup_fd, swap.old_fd, swap.new_fd):
            try:
                os.close(fd)
            except OSError:
                pass


