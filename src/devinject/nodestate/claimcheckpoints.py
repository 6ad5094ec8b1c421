"""The DRA drivers' checkpoints as the ledger reads them when it is rebuilt: a claim prepared on the node holds
its devices whether or not any container runs yet, and live evidence cannot show that. One file per driver,
`<state dir>/dra-<driver>.checkpoint.json` (dra/claims.py writes it, 0600, fsynced); each claim's `ledger`
entries are its bookings ([name, nodes, shared]), `pods` the pods it is reserved for and `consumes` its
consumable-capacity shares (node -> capacity -> [amount, total]).

This module owns the file's format: `DraCheckpoint`, its claims `ClaimRecord`s (devices `CheckpointDevice`,
bookings `CheckpointBooking`), read and written through them alone and byte for byte as before the records
(tests/fixtures/dra-checkpoints/ are goldens). Version 2 carries a checksum of its claims, as the
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
    from typing import NamedTuple, TypeAlias

    Json: TypeAlias = bool | int | float | str | list["Json"] | dict[str, "Json"] | None
    JsonObject: TypeAlias = dict[str, Json]
    Consumes: TypeAlias = dict[str, dict[str, tuple[int, int]]]  # node -> capacity -> (amount, total)
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
    if not all(isinstance(raw.get(k, ""), str) for k in ("namespace", "name")):
        return f"claim {uid}: a namespace or name that is not a string"
    mps, sharing = raw.get("mps", {}), raw.get("sharing", {})
    if not isinstance(mps, dict) or not all(isinstance(v, str) for v in mps.values()) or not isinstance(sharing, dict):
        return f"claim {uid}: mps is not GPU -> name, or sharing not request -> settings"
    if not isinstance(raw.get("ledger", []), list):
        return f"claim {uid}: ledger is not a list of [name, nodes, shared]"
    for booked in raw.get("ledger", []):
        if not (isinstance(booked, list) and len(booked) == 3 and isinstance(booked[0], str)
                and _strings(booked[1]) and _strings(booked[2])):
            return f"claim {uid}: a ledger entry that is not [name, nodes, shared]"
    return None


class CheckpointBooking(NamedTuple):
    """One of a claim's ledger bookings as checkpointed: `[name, nodes, shared]` on disk."""
    name: str
    nodes: tuple[str, ...]
    shared: tuple[str, ...]

    def to_json(self) -> Json:
        return [self.name, list(self.nodes), list(self.shared)]


class CheckpointDevice(NamedTuple):
    """One prepared device of a claim: the requests it serves, its (pool, device), its CDI names and the
    allocation's share of it (None: the key is absent, the device is the claim's alone). A field the driver
    adds is kept in `extra` as it is."""
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi: tuple[str, ...]
    share: str | None = None
    extra: JsonObject | None = None

    def to_json(self) -> Json:
        out: JsonObject = {**(self.extra or {}), "requests": list(self.requests), "pool": self.pool,
                           "device": self.device, "cdi": list(self.cdi)}
        if self.share is not None:
            out["share"] = self.share
        return out

    @classmethod
    def from_json(cls, raw: JsonObject) -> CheckpointDevice:  # checked by claim_problem
        share = raw.get("share")
        extra = {k: v for k, v in raw.items() if k not in _DEVICE_FIELDS}
        return cls(_tuple(raw["requests"]), str(raw["pool"]), str(raw["device"]), _tuple(raw["cdi"]),
                   share if isinstance(share, str) else None, extra or None)


class ClaimRecord(NamedTuple):
    """One prepared claim as the driver checkpoints it, read and written through this record alone. A field
    that is None is absent from the file (a version 1 checkpoint's claim may have no `pods`: it was written
    before claims recorded them), so a claim reads back and writes out byte for byte; a field the driver
    adds is kept in `extra` as it is (and covered by the checksum)."""
    spec: str  # the claim's CDI spec file as written (never trusted for a removal: Preparer.spec_path)
    devices: tuple[CheckpointDevice, ...]
    namespace: str | None = None
    name: str | None = None
    pods: tuple[str, ...] | None = None  # the pods it is reserved for
    ledger: tuple[CheckpointBooking, ...] | None = None  # its bookings
    sharing: JsonObject | None = None  # request -> its sharing settings (dra/gpuconfig.py GpuSharing.to_json)
    mps: dict[str, str] | None = None  # GPU -> what its MPS daemon's CUDA_VISIBLE_DEVICES names it by
    consumes: Consumes | None = None  # node -> capacity -> (amount, total) of its consumable-capacity shares
    extra: JsonObject | None = None

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def bookings(self) -> tuple[CheckpointBooking, ...]:
        return self.ledger or ()

    def consumes_json(self) -> dict[str, dict[str, list[int]]] | None:
        """The shares as the ledger books them (node -> capacity -> [amount, total]); None when it has none."""
        if not self.consumes:
            return None
        return {node: {cap: list(pair) for cap, pair in caps.items()} for node, caps in self.consumes.items()}

    def to_json(self) -> Json:
        out: JsonObject = {**(self.extra or {}), "spec": self.spec, "devices": [d.to_json() for d in self.devices]}
        consumes: Json = None if self.consumes is None else {
            node: {cap: [amount, total] for cap, (amount, total) in caps.items()}
            for node, caps in self.consumes.items()}
        optional: dict[str, Json] = {
            "namespace": self.namespace, "name": self.name, "sharing": self.sharing,
            "pods": None if self.pods is None else list(self.pods),
            "ledger": None if self.ledger is None else [b.to_json() for b in self.ledger],
            "mps": None if self.mps is None else dict(self.mps),
            "consumes": consumes}
        out.update({key: value for key, value in optional.items() if value is not None})
        return out

    @classmethod
    def from_json(cls, raw: JsonObject) -> ClaimRecord:  # checked by claim_problem
        ledger, pods, mps, consumes = raw.get("ledger"), raw.get("pods"), raw.get("mps"), raw.get("consumes")
        sharing, namespace, name = raw.get("sharing"), raw.get("namespace"), raw.get("name")
        extra = {k: v for k, v in raw.items() if k not in _CLAIM_FIELDS}
        return cls(
            str(raw["spec"]), tuple(CheckpointDevice.from_json(d) for d in _objects(raw["devices"])),
            namespace if isinstance(namespace, str) else None, name if isinstance(name, str) else None,
            None if pods is None else _tuple(pods),
            None if not isinstance(ledger, list) else tuple(
                CheckpointBooking(str(b[0]), _tuple(b[1]), _tuple(b[2])) for b in ledger if isinstance(b, list)),
            sharing if isinstance(sharing, dict) else None,
            {str(k): str(v) for k, v in mps.items()} if isinstance(mps, dict) else None,
            {str(node): {str(cap): (int(str(p[0])), int(str(p[1]))) for cap, p in _pairs(caps)}
             for node, caps in consumes.items()} if isinstance(consumes, dict) else None,
            extra or None)


_DEVICE_FIELDS = frozenset(CheckpointDevice._fields) - {"extra"}
_CLAIM_FIELDS = frozenset(ClaimRecord._fields) - {"extra"}


def _tuple(value: Json) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def _objects(value: Json) -> list[JsonObject]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _pairs(caps: Json) -> list[tuple[str, list[Json]]]:
    return [(k, v) for k, v in caps.items() if isinstance(v, list)] if isinstance(caps, dict) else []


class DraCheckpoint(NamedTuple):
    """One driver's prepared claims by claim UID."""
    claims: dict[str, ClaimRecord]
    version: int = CHECKPOINT_VERSION

    def claims_json(self) -> JsonObject:
        return {uid: record.to_json() for uid, record in self.claims.items()}

    def to_json(self) -> JsonObject:
        claims = self.claims_json()
        return {"version": CHECKPOINT_VERSION, "checksum": checksum_of(claims), "claims": claims}

    @classmethod
    def from_json(cls, raw: object, path: str) -> DraCheckpoint:
        data = need_object(raw, path)
        version = need_version(data, path, READABLE_VERSIONS, absent=None)
        claims = need_object(data.get("claims"), f"{path}.claims")
        if version >= 2 and need_str(data.get("checksum"), f"{path}.checksum") != checksum_of(claims):
            raise StateFileError(f"{path}.checksum: does not match its claims (a corrupt or edited checkpoint)")
        checked: dict[str, ClaimRecord] = {}
        for uid, entry in claims.items():
            problem = claim_problem(uid, entry)
            if problem:
                raise StateFileError(f"{path}: {problem}")
            assert isinstance(entry, dict)  # claim_problem's first check
            checked[uid] = ClaimRecord.from_json(entry)
        return cls(checked, version)

    def encode(self) -> bytes:
        return jsonlite.dumps(self.to_json(), sort_keys=True).encode()


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


def _checkpoints(state_dir: str) -> list[tuple[str, str, DraCheckpoint | None]]:
    """(file name, driver, its checkpoint or None when it cannot be read) of each checkpoint in the state dir."""
    try:
        names = sorted(os.listdir(state_dir))
    except OSError:
        return []
    return [(name, name[len(PREFIX):-len(SUFFIX)], _load(os.path.join(state_dir, name))) for name in names
            if name.startswith(PREFIX) and name.endswith(SUFFIX)]


def checkpointed_bookings(state_dir: str) -> tuple[dict[str, list[tuple[str, list[str], list[str]]]],
                                                    dict[str, list[str]], list[str]]:
    """(booking id -> its [name, nodes, shared] entries, booking id -> pods, the checkpoints that could not
    be read). A checkpoint that cannot be read is named, never guessed at."""
    bookings: dict[str, list[tuple[str, list[str], list[str]]]] = {}
    pods: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for filename, driver, checkpoint in _checkpoints(state_dir):
        if checkpoint is None:
            unreadable.append(filename)
            continue
        for uid, record in checkpoint.claims.items():
            if record.bookings:
                bookings[booking_id(driver, uid)] = [(b.name, list(b.nodes), list(b.shared)) for b in record.bookings]
                pods[booking_id(driver, uid)] = list(record.pods or ())
    return bookings, pods, unreadable


def checkpointed_consumes(state_dir: str) -> dict[str, dict[str, dict[str, list[int]]]]:
    """Booking id -> the claim's consumable-capacity shares, from the checkpoints that can be read."""
    out: dict[str, dict[str, dict[str, list[int]]]] = {}
    for _, driver, checkpoint in _checkpoints(state_dir):
        for uid, record in (checkpoint.claims if checkpoint is not None else {}).items():
            consumes = record.consumes_json()
            if consumes:
                out[booking_id(driver, uid)] = consumes
    return out
