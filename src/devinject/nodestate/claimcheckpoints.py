"""The DRA drivers' checkpoints as the ledger reads them when it is rebuilt: a claim prepared on the node holds
its devices whether or not any container runs yet, and live evidence cannot show that. One file per driver,
`<state dir>/dra-<driver>.checkpoint.json` (dra/claims.py writes it, 0600, fsynced); each claim's `ledger`
entries are its bookings ([name, nodes, shared]), `pods` the pods it is reserved for and `consumes` its
consumable-capacity shares (node -> capacity -> [amount, total]).

This module owns the file's format (`DraCheckpoint`): version 2 carries a checksum of its claims, as the
kubelet's own checkpoints do, so a file cut short, changed by a disk or edited by hand is refused rather
than believed (version 1, written before, had none and is still read; the next save writes version 2). A
checkpoint that fails is a StateFileError naming the file and the field: the driver prepares no claim until
it is repaired or removed (dra/claims.py), the ledger's rebuild names it in an event and books without it.
"""

from __future__ import annotations

import os
import stat

from devinject.core import jsonlite
from devinject.nodestate.statefile import StateFileError, need_object, need_str, need_version, parse_document

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

PREFIX, SUFFIX = "dra-", ".checkpoint.json"
CHECKPOINT_VERSION = 2  # 2: a checksum of the claims; 1 had none
READABLE_VERSIONS = (1, 2)
NODE_PID = 1  # a claim is held for the node (pid 1 lives as long as it runs) until it is unprepared
MAX_CHECKPOINT = 64 * 1024 * 1024


def consumes_problem(value: object) -> bool:
    """Whether `value` is not a booking's consumable-capacity record: node -> capacity name -> [amount,
    total], whole numbers, 0 <= amount <= total."""
    if not isinstance(value, dict):
        return True
    for caps in value.values():
        if not isinstance(caps, dict) or not caps:
            return True
        for pair in caps.values():
            if not (isinstance(pair, list) and len(pair) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in pair) and 0 <= pair[0] <= pair[1]):
                return True
    return False


def checkpoint_path(state_dir: str, driver: str) -> str:
    return os.path.join(state_dir, f"{PREFIX}{driver}{SUFFIX}")


def booking_id(driver: str, uid: str) -> str:
    return f"dra-claim:{driver}:{uid}"


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def checksum_of(claims: Mapping[str, object]) -> str:
    """The claims' checksum as a checkpoint carries it: sha256 of their canonical JSON (sorted keys)."""
    import hashlib  # here: the ledger imports this module only to rebuild

    return "sha256:" + hashlib.sha256(jsonlite.dumps(claims, sort_keys=True).encode()).hexdigest()


def claim_problem(uid: str, raw: object) -> str | None:
    """Why one checkpointed claim is not what the driver wrote (`claim <uid>: ...`), or None."""
    if not isinstance(raw, dict) or not isinstance(raw.get("spec"), str) or not isinstance(raw.get("devices"), list):
        return f"claim {uid}: expected spec and devices"
    for device in raw["devices"]:
        if not isinstance(device, dict) or not all(isinstance(device.get(k), str) for k in ("pool", "device")) \
                or not all(_strings(device.get(k)) for k in ("requests", "cdi")):
            return f"claim {uid}: a device without pool, device, requests and cdi"
        if not isinstance(device.get("share", ""), str):
            return f"claim {uid}: a device whose share is not a string"
    if consumes_problem(raw.get("consumes", {})):
        return f"claim {uid}: consumes is not node -> capacity -> [amount, total]"
    if not _strings(raw.get("pods", [])):
        return f"claim {uid}: pods is not a list of pod UIDs"
    for booked in raw.get("ledger", []):
        if not (isinstance(booked, list) and len(booked) == 3 and isinstance(booked[0], str)
                and _strings(booked[1]) and _strings(booked[2])):
            return f"claim {uid}: a ledger entry that is not [name, nodes, shared]"
    return None


class DraCheckpoint(NamedTuple):
    """One driver's prepared claims by claim UID, each as the driver recorded it (`spec`, `devices`, `pods`,
    `ledger`, and what its sharing adds: a field the driver adds is kept as it is, and covered by the
    checksum)."""
    claims: dict[str, dict[str, object]]
    version: int = CHECKPOINT_VERSION

    def to_json(self) -> dict[str, object]:
        return {"version": CHECKPOINT_VERSION, "checksum": checksum_of(self.claims), "claims": self.claims}

    @classmethod
    def from_json(cls, raw: object, path: str) -> DraCheckpoint:
        data = need_object(raw, path)
        version = need_version(data, path, READABLE_VERSIONS, absent=None)
        claims = need_object(data.get("claims"), f"{path}.claims")
        if version >= 2 and need_str(data.get("checksum"), f"{path}.checksum") != checksum_of(claims):
            raise StateFileError(f"{path}.checksum: does not match its claims (a corrupt or edited checkpoint)")
        checked: dict[str, dict[str, object]] = {}
        for uid, entry in claims.items():
            problem = claim_problem(uid, entry)
            if problem:
                raise StateFileError(f"{path}: {problem}")
            checked[uid] = need_object(entry, f"{path}.claims[{uid!r}]")
        return cls(checked, version)

    def encode(self) -> bytes:
        return jsonlite.dumps(self.to_json(), sort_keys=True).encode()


def strings_of(value: object) -> tuple[str, ...]:
    """A checkpointed claim's list of strings (`pods`, `mps`, a device's `requests` and `cdi`) as a tuple;
    () where it has none."""
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def objects_of(value: object) -> list[dict[str, object]]:
    """A checkpointed claim's list of objects (its `devices`)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def bookings_of(entry: Mapping[str, object]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """A checkpointed claim's `ledger` entries: (name, nodes, shared nodes) each."""
    ledger = entry.get("ledger")
    return [(str(b[0]), strings_of(b[1]), strings_of(b[2])) for b in ledger if isinstance(b, list) and len(b) == 3] \
        if isinstance(ledger, list) else []


def consumes_of(entry: Mapping[str, object]) -> dict[str, dict[str, list[int]]] | None:
    """A checkpointed claim's consumable-capacity shares (node -> capacity -> [amount, total]); None when it
    holds none."""
    consumes = entry.get("consumes")
    if not isinstance(consumes, dict) or not consumes or consumes_problem(consumes):
        return None
    return {str(node): {str(name): [int(v) for v in pair] for name, pair in capacities.items()}
            for node, capacities in consumes.items()}


def parse_checkpoint(data: bytes, path: str) -> DraCheckpoint:
    """A checkpoint file's bytes as its record; StateFileError naming the file and the field."""
    return DraCheckpoint.from_json(parse_document(data, path), path)


def _load(path: str) -> DraCheckpoint | None:
    """A checkpoint: a regular file of this user's nobody else can write, that parses; None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        return parse_checkpoint(os.read(fd, MAX_CHECKPOINT), path)
    except (OSError, StateFileError):
        return None
    finally:
        os.close(fd)


def checkpointed_bookings(state_dir: str) -> tuple[dict[str, list[tuple[str, list[str], list[str]]]],
                                                    dict[str, list[str]], list[str]]:
    """(booking id -> its [name, nodes, shared] entries, booking id -> pods, the checkpoints that could not
    be read). A checkpoint that cannot be read is named, never guessed at."""
    bookings: dict[str, list[tuple[str, list[str], list[str]]]] = {}
    pods: dict[str, list[str]] = {}
    unreadable: list[str] = []
    try:
        names = sorted(os.listdir(state_dir))
    except OSError:
        return {}, {}, []
    for filename in names:
        if not (filename.startswith(PREFIX) and filename.endswith(SUFFIX)):
            continue
        driver = filename[len(PREFIX):-len(SUFFIX)]
        checkpoint = _load(os.path.join(state_dir, filename))
        if checkpoint is None:
            unreadable.append(filename)
            continue
        for uid, entry in checkpoint.claims.items():  # each checked whole by the record
            ledger, claimed_for = entry.get("ledger", []), entry.get("pods", [])
            booked = [(b[0], b[1], b[2]) for b in ledger] if isinstance(ledger, list) else []
            if booked:
                bookings[booking_id(driver, uid)] = booked
                pods[booking_id(driver, uid)] = list(claimed_for) if isinstance(claimed_for, list) else []
    return bookings, pods, unreadable


def checkpointed_consumes(state_dir: str) -> dict[str, dict[str, dict[str, list[int]]]]:
    """Booking id -> the claim's consumable-capacity shares, from the checkpoints that can be read (one whose
    `consumes` is not node -> capacity -> [amount, total] counts as none: its claim is then booked as the
    driver's rebook books it, which reads its own checkpoint)."""
    out: dict[str, dict[str, dict[str, list[int]]]] = {}
    try:
        names = sorted(os.listdir(state_dir))
    except OSError:
        return {}
    for filename in names:
        if not (filename.startswith(PREFIX) and filename.endswith(SUFFIX)):
            continue
        checkpoint = _load(os.path.join(state_dir, filename))
        for uid, entry in (checkpoint.claims if checkpoint is not None else {}).items():
            consumes = entry.get("consumes")  # checked by the record: node -> capacity -> [amount, total]
            if isinstance(consumes, dict) and consumes:
                out[booking_id(filename[len(PREFIX):-len(SUFFIX)], uid)] = consumes
    return out
