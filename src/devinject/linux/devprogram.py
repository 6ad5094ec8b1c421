"""cgroup v2's device program, read only: the bpf(2) call, the query of a cgroup's BPF_CGROUP_DEVICE programs
and their instructions, and the format of devinject's own prefix (what hook/bpf.py writes) with its decoding.
The hook reads a program before it swaps it (hook/bpf.py); the ledger's evidence reads which nodes a
container's program grants (nodestate/evidence.py). A thin layer on linux/libc.py."""

from __future__ import annotations

import os
import struct

from devinject.core.errors import HookError
from devinject.linux import libc
from devinject.linux.devcgroup import AllowDevice

# bpf(2) commands and the attach type read here (include/uapi/linux/bpf.h)
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_CGROUP_DEVICE = 6
SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361}

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }: type in the low 16 bits
DEV_TYPES = {"b": 1, "c": 2}
ACCESS_BITS = {"m": 1, "r": 2, "w": 4}

# devinject's prefix: a marker, the rule count, a header of HEADER_LEN instructions, RULE_LEN per rule
MARKER = 0x64657669  # "devi": first instruction of a devinject prefix
INSN = struct.Struct("<BBhi")
RULE_LEN = 8
HEADER_LEN = 8


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return INSN.pack(code, (src << 4) | dst, off, imm)


def mov_imm(dst: int, imm: int) -> bytes:
    return insn(0xB7, dst, imm=imm)  # BPF_ALU64 | BPF_MOV | BPF_K


def decode_rules(program: bytes) -> tuple[tuple[AllowDevice, ...], bytes]:
    """Split off a devinject prefix: (rules it allowed, the original program)."""
    if len(program) < HEADER_LEN * 8 or program[:8] != mov_imm(0, MARKER):
        return (), program
    count = INSN.unpack_from(program, 8)[3]
    rules = []
    types = {v: k for k, v in DEV_TYPES.items()}
    for index in range(count):
        base = (HEADER_LEN + RULE_LEN * index) * 8
        dev_type = INSN.unpack_from(program, base)[3]
        denied = INSN.unpack_from(program, base + 16)[3]
        major = INSN.unpack_from(program, base + 32)[3]
        minor = INSN.unpack_from(program, base + 40)[3]
        access = "".join(ch for ch in "rwm" if not denied & ACCESS_BITS[ch])
        rules.append(AllowDevice(types[dev_type], major, minor, access))
    return tuple(rules), program[(HEADER_LEN + RULE_LEN * count) * 8:]


# --- the bpf(2) edge --------------------------------------------------------------------------------


def bpf_call(cmd: int, attr: libc.Array) -> int:
    number = SYS_BPF.get(os.uname().machine)
    if number is None:
        raise HookError(f"cgroup v2 device rules: bpf(2) number unknown on {os.uname().machine}")
    result = libc.function("syscall")(libc.Long(number), libc.Long(cmd), attr, libc.Long(len(attr)))
    if result < 0:
        err = libc.errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def bpf_attr(*fields: tuple[str, int, int]) -> libc.Array:
    buf = libc.buffer(128)
    for fmt, offset, value in fields:
        struct.pack_into(fmt, buf, offset, value)
    return buf


def query_programs(cgroup_fd: int) -> tuple[list[int], int]:
    ids = libc.buffer(64 * 4)  # u32 program ids
    attr = bpf_attr(("<I", 0, cgroup_fd), ("<I", 4, BPF_CGROUP_DEVICE), ("<Q", 16, libc.addressof(ids)),
                 ("<I", 24, 64))
    bpf_call(BPF_PROG_QUERY, attr)
    flags, count = struct.unpack_from("<I", attr, 12)[0], struct.unpack_from("<I", attr, 24)[0]
    return list(struct.unpack_from(f"<{count}I", ids)), flags


def program_fd(prog_id: int) -> int:
    return bpf_call(BPF_PROG_GET_FD_BY_ID, bpf_attr(("<I", 0, prog_id)))


def program_instructions(prog_fd: int) -> bytes:
    info = libc.buffer(256)
    attr = bpf_attr(("<I", 0, prog_fd), ("<I", 4, len(info)), ("<Q", 8, libc.addressof(info)))
    bpf_call(BPF_OBJ_GET_INFO_BY_FD, attr)
    length = struct.unpack_from("<I", info, 20)[0]
    insns = libc.buffer(length)
    info = libc.buffer(256)
    struct.pack_into("<I", info, 20, length)
    struct.pack_into("<Q", info, 32, libc.addressof(insns))
    attr = bpf_attr(("<I", 0, prog_fd), ("<I", 4, len(info)), ("<Q", 8, libc.addressof(info)))
    bpf_call(BPF_OBJ_GET_INFO_BY_FD, attr)
    return insns.raw[:length]


def granted_rules(cgroup_path: str) -> tuple[AllowDevice, ...]:
    """The rules a devinject prefix on the cgroup's device program allows (read only; () when none)."""
    try:
        cgroup_fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        rules: list[AllowDevice] = []
        for prog_id in query_programs(cgroup_fd)[0]:
            prog_fd = program_fd(prog_id)
            try:
                rules += decode_rules(program_instructions(prog_fd))[0]
            finally:
                os.close(prog_fd)
        return tuple(rules)
    except OSError:
        return ()
    finally:
        os.close(cgroup_fd)
