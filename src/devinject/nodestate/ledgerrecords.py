"""ledger.json's records: one `LedgerEntry` per booking, `LedgerFile` for the file, `ledger_problem` for its
check. The one parser and writer of the ledger's format (and of ledger-claims.json, a copy of its claims'
bookings): nodestate/ledger.py reads and writes the files under its lock through these records, and every
reader (the hook's grant checks, `list`/`who`, doctor, the device plugin, the DRA driver) gets them. Parsed
and written back, a booking gives the same JSON as before (tests/fixtures/ledger/, the golden files).

Kept lean as every module the hook imports: no `typing` at run time (core/records.py's NamedTuple).
"""

from __future__ import annotations

from devinject.nodestate.claimcheckpoints import consumes_problem

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

LEDGER_VERSION = 1  # ledger.json's format; a file without `version` (written before it had one) is version 1

Consumes = dict[str, dict[str, list[int]]]  # node -> capacity name -> [amount, the device's total]


class LedgerEntry(NamedTuple):
    """One booking as ledger.json holds it, read and written by every user of the ledger: the device names,
    the nodes it holds exclusively and shared, the process it is for (pid and start time; pid 1 for a claim's
    or the device plugin's), `active` or `reclaiming` (since `released_at`); a container's `pod`, a claim's or
    the plugin's `pods`, the plugin's resource (`plugin`); `recovered` when a rebuild booked it from live
    evidence; `consumes`, a claim's consumable-capacity shares (node -> capacity -> [amount, total]).

    Immutable (a change is `_replace`, `consumes` never changed in place); `from_json(e).to_json()` gives the
    entry's JSON back as the file held it (numbers keep their type), so a rewrite changes no byte of a
    booking it did not change."""
    devices: tuple[str, ...]
    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    pid: int
    start_time: int
    state: str = "active"
    time: float = 0.0
    own_pid_ns: bool = False
    pod: str | None = None
    pods: tuple[str, ...] | None = None
    plugin: str | None = None
    recovered: bool = False
    released_at: float | None = None
    consumes: Consumes | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> LedgerEntry:
        """An entry of a ledger `ledger_problem` passed (so every field has its type)."""
        get = raw.get
        pods, consumes = get("pods"), get("consumes")
        return cls(_tuple(get("devices")), _tuple(get("exclusive")), _tuple(get("shared")), _int(get("pid")),
                   _int(get("start_time")), str(get("state", "active")), _number(get("time")),
                   get("own_pid_ns") is True, _str(get("pod")), None if pods is None else _tuple(pods),
                   _str(get("plugin")), get("recovered") is True,
                   None if get("released_at") is None else _number(get("released_at")),
                   _consumes(consumes) if isinstance(consumes, dict) else None)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"devices": list(self.devices), "exclusive": list(self.exclusive),
                                  "shared": list(self.shared), "pid": self.pid, "start_time": self.start_time,
                                  "state": self.state, "time": self.time, "own_pid_ns": self.own_pid_ns}
        for key, value in (("pod", self.pod), ("plugin", self.plugin), ("released_at", self.released_at)):
            if value is not None:
                out[key] = value
        if self.pods is not None:
            out["pods"] = list(self.pods)
        if self.recovered:
            out["recovered"] = True
        if self.consumes is not None:
            out["consumes"] = _consumes(self.consumes)
        return out

    def holds(self, nodes: set[str]) -> bool:
        """Whether it holds one of `nodes`, exclusively or shared."""
        return not nodes.isdisjoint(self.exclusive) or not nodes.isdisjoint(self.shared)

    @property
    def nodes(self) -> set[str]:
        """Every node it holds, exclusively or shared."""
        return set(self.exclusive) | set(self.shared)


class LedgerFile(NamedTuple):
    """ledger.json: the bookings by id (a booking's id: a container's id, `dra-claim:<driver>:<uid>`,
    `device-plugin:<resource>:<ID>`, `recovered: <source>`) and the pid namespace their pids belong to.
    Parsed here once, at the file's edge; everyone else reads the records."""
    allocations: dict[str, LedgerEntry]
    pid_namespace: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> LedgerFile:
        """A ledger `ledger_problem` passed."""
        allocations = data.get("allocations")
        namespace = data.get("pid_namespace")
        return cls({cid: LedgerEntry.from_json(entry) for cid, entry in allocations.items()}
                   if isinstance(allocations, dict) else {}, namespace if isinstance(namespace, str) else None)

    def to_json(self) -> dict[str, object]:
        return {"allocations": allocations_json(self.allocations), "version": LEDGER_VERSION,
                **({"pid_namespace": self.pid_namespace} if self.pid_namespace is not None else {})}


def allocations_json(allocations: Mapping[str, LedgerEntry]) -> dict[str, object]:
    return {cid: entry.to_json() for cid, entry in allocations.items()}


def _tuple(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _number(value: object) -> float:
    """A JSON number as the file holds it (an int stays one: written back, it reads the same)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _consumes(value: Mapping[str, object]) -> Consumes:
    """A copy of node -> capacity -> [amount, total] (checked by consumes_problem)."""
    return {str(node): {str(name): [int(v) for v in pair] for name, pair in caps.items()}
            for node, caps in value.items() if isinstance(caps, dict)}


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def ledger_problem(data: object) -> str | None:
    """Why `data` is not a ledger devinject can rely on (a string where a list belongs would silently
    disable the clash check), or None."""
    if not isinstance(data, dict) or not isinstance(data.get("allocations"), dict):
        return "not a devinject ledger"
    version = data.get("version", LEDGER_VERSION)
    if version != LEDGER_VERSION or isinstance(version, bool):
        return f"version {version!r} is not one this devinject reads ({LEDGER_VERSION})"
    if not isinstance(data.get("pid_namespace", ""), str):
        return "pid_namespace is not a string"
    for cid, entry in data["allocations"].items():
        if not isinstance(entry, dict):
            return f"allocation {cid}: not an object"
        for key in ("devices", "exclusive", "shared"):
            if not _strings(entry.get(key, [])):
                return f"allocation {cid}: {key} is not a list of strings"
        for key in ("pid", "start_time"):
            if not isinstance(entry.get(key), int) or isinstance(entry.get(key), bool):
                return f"allocation {cid}: {key} is not an integer"
        if entry.get("state") not in ("active", "reclaiming"):
            return f"allocation {cid}: state is not active or reclaiming"
        if not isinstance(entry.get("own_pid_ns", False), bool):
            return f"allocation {cid}: own_pid_ns is not a boolean"
        if not isinstance(entry.get("pod", ""), str):
            return f"allocation {cid}: pod is not a string"
        if not _strings(entry.get("pods", [])):
            return f"allocation {cid}: pods is not a list of strings"
        if not isinstance(entry.get("plugin", ""), str):
            return f"allocation {cid}: plugin is not a string"
        if consumes_problem(entry.get("consumes", {})):
            return f"allocation {cid}: consumes is not node -> capacity -> [amount, total]"
    return None
