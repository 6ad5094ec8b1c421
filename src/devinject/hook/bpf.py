"""cgroup v2 device access: prepend allow rules to the container's BPF_CGROUP_DEVICE program.

The instruction encoder is pure (tested byte for byte); the bpf(2) edge is a thin layer on core/libc.py. Our
prefix starts with a marker so a second run for the same container replaces it instead of stacking another.
"""

from __future__ import annotations

import os
import resource
import struct

from devinject.core import libc
from devinject.core.errors import HookError
from devinject.hook.plan import AllowDevice

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


# bpf(2) commands, program and attach types, flags (include/uapi/linux/bpf.h)
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4
SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361}

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }: type in the low 16 bits
DEV_TYPES = {"b": 1, "c": 2}
ACCESS_BITS = {"m": 1, "r": 2, "w": 4}

MARKER = 0x64657669  # "devi": first instruction of a devinject prefix
_INSN = struct.Struct("<BBhi")
_RULE_LEN = 8
_HEADER_LEN = 8


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return _INSN.pack(code, (src << 4) | dst, off, imm)


def _mov_imm(dst: int, imm: int) -> bytes:
    return insn(0xB7, dst, imm=imm)  # BPF_ALU64 | BPF_MOV | BPF_K


def _ldx_w(dst: int, src: int, off: int) -> bytes:
    return insn(0x61, dst, src, off)  # BPF_LDX | BPF_W | BPF_MEM


def _jne_imm(dst: int, imm: int, off: int) -> bytes:
    return insn(0x55, dst, off=off, imm=imm)  # BPF_JMP | BPF_JNE | BPF_K


def encode_prefix(rules: tuple[AllowDevice, ...]) -> bytes:
    """Instructions that return 1 (allow) for any of `rules`, else fall through to what follows."""
    out = [
        _mov_imm(0, MARKER),
        _mov_imm(0, len(rules)),  # rule count: lets the next run find where the original program starts
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
            _mov_imm(0, 1),
            insn(0x95),  # exit
        ]
    return b"".join(out)


def decode_rules(program: bytes) -> tuple[tuple[AllowDevice, ...], bytes]:
    """Split off a devinject prefix: (rules it allowed, the original program)."""
    if len(program) < _HEADER_LEN * 8 or program[:8] != _mov_imm(0, MARKER):
        return (), program
    count = _INSN.unpack_from(program, 8)[3]
    rules = []
    types = {v: k for k, v in DEV_TYPES.items()}
    for index in range(count):
        base = (_HEADER_LEN + _RULE_LEN * index) * 8
        dev_type = _INSN.unpack_from(program, base)[3]
        denied = _INSN.unpack_from(program, base + 16)[3]
        major = _INSN.unpack_from(program, base + 32)[3]
        minor = _INSN.unpack_from(program, base + 40)[3]
        access = "".join(ch for ch in "rwm" if not denied & ACCESS_BITS[ch])
        rules.append(AllowDevice(types[dev_type], major, minor, access))
    return tuple(rules), program[(_HEADER_LEN + _RULE_LEN * count) * 8:]


# --- the bpf(2) edge --------------------------------------------------------------------------------


def _bpf(cmd: int, attr: libc.Array) -> int:
    number = SYS_BPF.get(os.uname().machine)
    if number is None:
        raise HookError(f"cgroup v2 device rules: bpf(2) number unknown on {os.uname().machine}")
    result = libc.function("syscall")(libc.Long(number), libc.Long(cmd), attr, libc.Long(len(attr)))
    if result < 0:
        err = libc.errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def _attr(*fields: tuple[str, int, int]) -> libc.Array:
    buf = libc.buffer(128)
    for fmt, offset, value in fields:
        struct.pack_into(fmt, buf, offset, value)
    return buf


def _query(cgroup_fd: int) -> tuple[list[int], int]:
    ids = libc.buffer(64 * 4)  # u32 program ids
    attr = _attr(("<I", 0, cgroup_fd), ("<I", 4, BPF_CGROUP_DEVICE), ("<Q", 16, libc.addressof(ids)),
                 ("<I", 24, 64))
    _bpf(BPF_PROG_QUERY, attr)
    flags, count = struct.unpack_from("<I", attr, 12)[0], struct.unpack_from("<I", attr, 24)[0]
    return list(struct.unpack_from(f"<{count}I", ids)), flags


def _prog_fd(prog_id: int) -> int:
    return _bpf(BPF_PROG_GET_FD_BY_ID, _attr(("<I", 0, prog_id)))


def _xlated(prog_fd: int) -> bytes:
    info = libc.buffer(256)
    attr = _attr(("<I", 0, prog_fd), ("<I", 4, len(info)), ("<Q", 8, libc.addressof(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    length = struct.unpack_from("<I", info, 20)[0]
    insns = libc.buffer(length)
    info = libc.buffer(256)
    struct.pack_into("<I", info, 20, length)
    struct.pack_into("<Q", info, 32, libc.addressof(insns))
    attr = _attr(("<I", 0, prog_fd), ("<I", 4, len(info)), ("<Q", 8, libc.addressof(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    return insns.raw[:length]


def _load(program: bytes) -> int:
    code = libc.buffer(len(program), program)
    license_ = libc.buffer(len(b"Apache") + 1, b"Apache")
    log = libc.buffer(65536)
    attr = _attr(("<I", 0, BPF_PROG_TYPE_CGROUP_DEVICE), ("<I", 4, len(program) // 8),
                 ("<Q", 8, libc.addressof(code)), ("<Q", 16, libc.addressof(license_)),
                 ("<I", 24, 1), ("<I", 28, len(log)), ("<Q", 32, libc.addressof(log)),
                 ("<I", 68, BPF_CGROUP_DEVICE))
    struct.pack_into("16s", attr, 48, b"devinject")
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except OSError as err:
        detail = log.value.decode(errors="replace").strip().splitlines()
        raise HookError(f"cgroup v2: loading the device program failed: {err.strerror}"
                        f"{': ' + detail[-1] if detail else ''}") from None


def _replace(cgroup_fd: int, new_fd: int, old_fd: int, flags: int) -> None:
    if flags & BPF_F_ALLOW_MULTI:
        _bpf(BPF_PROG_ATTACH, _attr(("<I", 0, cgroup_fd), ("<I", 4, new_fd), ("<I", 8, BPF_CGROUP_DEVICE),
                                    ("<I", 12, BPF_F_ALLOW_MULTI | BPF_F_REPLACE), ("<I", 16, old_fd)))
    else:  # a single non-multi program: attaching another replaces it
        _bpf(BPF_PROG_ATTACH, _attr(("<I", 0, cgroup_fd), ("<I", 4, new_fd), ("<I", 8, BPF_CGROUP_DEVICE),
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
        prog_ids, flags = _query(cgroup_fd)
        if not prog_ids:
            os.close(cgroup_fd)
            return None  # no device program: the cgroup does not restrict devices
        if len(prog_ids) > 1:
            raise HookError(f"{cgroup_path}: {len(prog_ids)} device programs attached; expected the runtime's one")
        old_fd = _prog_fd(prog_ids[0])
        previous, original = decode_rules(_xlated(old_fd))
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


def granted_rules(cgroup_path: str) -> tuple[AllowDevice, ...]:
    """The rules a devinject prefix on the cgroup's device program allows (read only; () when none)."""
    try:
        cgroup_fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        rules: list[AllowDevice] = []
        for prog_id in _query(cgroup_fd)[0]:
            prog_fd = _prog_fd(prog_id)
            try:
                rules += decode_rules(_xlated(prog_fd))[0]
            finally:
                os.close(prog_fd)
        return tuple(rules)
    except OSError:
        return ()
    finally:
        os.close(cgroup_fd)
