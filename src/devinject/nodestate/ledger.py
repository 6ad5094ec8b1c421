"""The node-local ledger: which container holds which device, so an exclusive device is never handed out
twice. One JSON file under the state dir, rewritten atomically under an exclusive file lock.

A device's identity is its own char nodes (`c 195:2`, taken from the host node when a spec leaves the
numbers out), so `gpu=0`, `gpu=GPU-…` and `gpu=all` that share a node conflict with each other. Allocations
of dead containers (pid + start time, so pid reuse cannot fool it; a zombie is dead) are reclaimed on every
access; a released device stays `reclaiming` while a container's process (evidence.py: not a host
daemon's, nor anyone's namespace) still holds one of its nodes open — unless the container had a pid
namespace of its own: once its init is gone, the kernel has ended all its other processes.

A ledger file that cannot be parsed or fails validation never wedges the node: its bytes are kept aside
(for forensics, with an event) and the bookings are rebuilt from live evidence (see evidence.py) and
written over it at once, so the rebuild holds whatever the booking that found it decides.
"""

from __future__ import annotations

import os
import time

from devinject.core import atomicfile, jsonlite
from devinject.core.errors import LedgerError
from devinject.linux.filelock import exclusive
from devinject.linux.trusteddir import trusted_dir
from devinject.nodestate import events, healthverdicts
from devinject.nodestate.claimcheckpoints import consumes_problem
from devinject.nodestate.statefile import StateFileError, UnreadableStateFile, problem_in

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, NamedTuple

    from devinject.cdi.identity import NodeId, QualifiedName
else:
    from devinject.core.records import NamedTuple


LEDGER_FILE = "ledger.json"
LEDGER_VERSION = 1  # ledger.json's format; a file without `version` (written before it had one) is version 1
LOCK_FILE = "ledger.lock"
CLAIMS_FILE = "ledger-claims.json"  # the claims' bookings alone (DRA), beside the ledger: a rebuild keeps them
HEALTH_FILE = healthverdicts.HEALTH_FILE  # owned by nodestate/healthverdicts.py
LOCK_TIMEOUT = 10.0
RECLAIM_TIMEOUT = 30.0


def process_start_time(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot); None when the process is gone — or a zombie
    (killed, not yet reaped: it holds nothing any more and will never run again)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    if len(fields) <= 19 or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def has_own_pid_namespace(pid: int, proc: str = "/proc") -> bool:
    """Whether process `pid` is in another pid namespace than this process (a container's init usually
    is). False when either cannot be read."""
    try:
        return os.stat(f"{proc}/{pid}/ns/pid").st_ino != os.stat(f"{proc}/self/ns/pid").st_ino
    except OSError:
        return False


def read_entries(state_dir: str) -> dict[str, LedgerEntry]:
    """The ledger's bookings as they are now (no lock, no housekeeping: the file is replaced whole), read as a
    file the hook may act on: a regular file of this user's that nobody else can write, no link followed.
    Empty when it is missing, not that, or fails validation (the next booking rebuilds it)."""
    import stat

    try:
        fd = os.open(os.path.join(state_dir, LEDGER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return {}
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        data = jsonlite.loads(b"".join(chunks))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    finally:
        os.close(fd)
    if ledger_problem(data) is not None:
        return {}
    return {cid: LedgerEntry.from_json(entry) for cid, entry in data["allocations"].items()}


class ForeignLedgerError(LedgerError):
    """The ledger's pids belong to another pid namespace than this process's."""


class Claim(NamedTuple):
    """One requested device and the identities of its nodes (`c 195:0`). `shared` names nodes of it that
    other containers may hold at the same time (those its kinds share, in a bundle; the parent GPU of a MIG
    device); the rest are booked as the kind's policy says."""
    name: QualifiedName | str
    nodes: tuple[NodeId, ...]
    shared: tuple[NodeId, ...] = ()


class LedgerEntry(NamedTuple):
    """One booking as ledger.json holds it, for readers outside the ledger (`list`, `who`): the device names,
    the nodes it holds exclusively and shared, the process it is for (pid and start time; pid 1 for a claim's
    or the device plugin's), `active` or `reclaiming`; a container's `pod`, a claim's or the plugin's
    `pods`, the plugin's resource (`plugin`); `recovered` when a rebuild booked it from live evidence."""
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

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> LedgerEntry:
        """An entry of a ledger `ledger_problem` passed (so every field has its type)."""
        get = raw.get
        pods = get("pods")
        return cls(_tuple(get("devices")), _tuple(get("exclusive")), _tuple(get("shared")), _int(get("pid")),
                   _int(get("start_time")), str(get("state", "active")), _float(get("time")),
                   get("own_pid_ns") is True, _str(get("pod")), None if pods is None else _tuple(pods),
                   _str(get("plugin")), get("recovered") is True,
                   None if get("released_at") is None else _float(get("released_at")))

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
        return out

    def holds(self, nodes: set[str]) -> bool:
        """Whether it holds one of `nodes`, exclusively or shared."""
        return not nodes.isdisjoint(self.exclusive) or not nodes.isdisjoint(self.shared)


def _tuple(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _float(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


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


Consumes = dict[str, dict[str, list[int]]]  # node -> capacity name -> [amount, the device's total]


def capacity_clash(nodes: set[str], consumes: Consumes, entry: dict[str, Any]) -> tuple[str, str] | None:
    """(node, why) when a booking of `nodes` consuming `consumes` (consumable capacity: DRAConsumableCapacity
    shares) cannot stand beside `entry`: a capacity share meets only other capacity shares of its device,
    never a booking that holds the node otherwise (exclusive, a time-sliced container, a device-plugin
    replica), either way round; and the shares of a node never sum beyond its capacity (checked in
    capacity_left)."""
    theirs: Consumes = entry.get("consumes") or {}
    held = set(entry.get("exclusive", [])) | set(entry.get("shared", []))
    for node in sorted(nodes & held):
        if (node in consumes) != (node in theirs):
            return node, ("shared by consumable capacity" if node in theirs else "held outside consumable capacity")
    return None


def capacity_left(consumes: Consumes, allocations: dict[str, Any], skip: str) -> str | None:
    """Why `consumes` does not fit beside the other bookings' shares of the same nodes (None: it fits):
    the sum of every booking's amount of a capacity, this one's included, at most the device's total (the
    scheduler's view may be stale; the ledger is the node's word)."""
    for node, caps in sorted(consumes.items()):
        for name, (amount, total) in sorted(caps.items()):
            used = 0
            users = []
            for cid, entry in allocations.items():
                theirs = (entry.get("consumes") or {}).get(node, {}).get(name)
                if cid != skip and theirs:
                    used += theirs[0]
                    users.append(cid)
            if used + amount > total:
                return (f"device {node}: {name} {amount} asked, {total - used} of {total} left (held by "
                        f"{', '.join(sorted(users)[:4])}{', ...' if len(users) > 4 else ''})")
    return None


def claim_bookings(data: dict[str, Any]) -> dict[str, Any]:
    """The bookings held for pods rather than for a process: DRA claims' (`pods`, the pods a claim is reserved
    for) and the device plugin's (`plugin`, its resource; `pods`, the pod the kubelet gave the device to, once
    known). No live evidence shows them when a lost ledger is rebuilt (a pod's containers may not run yet);
    kept in CLAIMS_FILE as well."""
    return {name: entry for name, entry in data.get("allocations", {}).items() if "pods" in entry}


PLUGIN_PREFIX = "device-plugin:"  # the device plugin's bookings: device-plugin:<resource>:<device ID>


def plugin_booking_id(resource: str, device_id: str) -> str:
    return f"{PLUGIN_PREFIX}{resource}:{device_id}"


def plugin_device_id(booking_id: str) -> str:
    """The device ID of a `device-plugin:<resource>:<ID>` booking (a resource name has no colon; an ID, a PCI
    address, has)."""
    return booking_id.split(":", 2)[2] if booking_id.count(":") >= 2 else ""


def is_plugin(entry: dict[str, Any]) -> bool:
    """A booking the device plugin made in Allocate: a device the kubelet gave a pod."""
    return isinstance(entry.get("plugin"), str)


def is_claim(entry: dict[str, Any]) -> bool:
    """A DRA claim's booking (held for the pods it is reserved for)."""
    return "pods" in entry and not is_plugin(entry)


def held_nodes(data: dict[str, Any], which: Callable[[dict[str, Any]], bool]) -> tuple[set[str], set[str]]:
    """The nodes the bookings `which` picks hold: (exclusive, shared)."""
    exclusive: set[str] = set()
    shared: set[str] = set()
    for entry in data.get("allocations", {}).values():
        if which(entry):  # reclaiming too: a booking refuses them until their holders are gone
            exclusive.update(entry.get("exclusive", ()))
            shared.update(entry.get("shared", ()))
    return exclusive, shared


def clashes(exclusive: Iterable[str], shared: Iterable[str], held: tuple[set[str], set[str]]) -> set[str]:
    """The nodes of a holding (exclusive, shared) that clash with what others hold (held_nodes): exclusive
    against anything held, shared against what is held exclusively."""
    return set(exclusive) & (held[0] | held[1]) | set(shared) & held[0]


def describe(booking_id: str, entry: dict[str, Any]) -> str:
    """Who holds a device, for an error a person reads (the kubelet's event, the driver's log)."""
    if is_plugin(entry):
        pods = entry.get("pods") or ["not known yet"]
        return (f"the device plugin: {entry['plugin']} device {plugin_device_id(booking_id)}, "
                f"pod {', '.join(pods)}")
    state = entry.get("state", "active")
    return f"container {booking_id} ({state}, pid {entry.get('pid')})"


def same_pod(booking: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether one of two bookings is a claim's (`pods`: the pods it is reserved for) and the other a
    container of one of those pods (`pod`, read from its cgroup): the claim holds its devices for that pod's
    containers, so theirs is no clash, whichever was booked first."""
    return booking.get("pod") in other.get("pods", ()) or other.get("pod") in booking.get("pods", ())


def holders_of(nodes: set[str], proc: str = "/proc", *, containers_only: bool = False) -> dict[str, list[int]]:
    """Processes with one of `nodes` ("c 195:2") open for I/O: node -> pids. Scans /proc/*/fd.
    `containers_only`: only containers' processes, as the evidence module defines them (another mount
    namespace, and the node granted by their own device cgroup): a host daemon keeping every GPU open, or
    anyone's `unshare -Urm` holding a node, is not a container's use."""
    from devinject.nodestate.evidence import container_holders, open_device_nodes, processes

    if not nodes:
        return {}
    if containers_only:
        return container_holders(nodes, proc)
    found: dict[str, list[int]] = {}
    for pid in processes(proc):
        for key in open_device_nodes(pid, proc):
            if key in nodes:
                found.setdefault(key, []).append(pid)
    return found


class _Locked:
    """`with ledger.locked() as data:` (a class, not contextlib: see filelock)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.lock = exclusive(os.path.join(ledger.state_dir, LOCK_FILE), timeout=LOCK_TIMEOUT, what="ledger",
                              error=LedgerError)
        self.data: dict[str, Any] = {}
        self.before = ""

    def __enter__(self) -> dict[str, Any]:
        self.lock.__enter__()
        try:
            self.data = self.ledger._read()
            self.before = jsonlite.dumps(self.data, sort_keys=True)
        except BaseException:
            self.lock.__exit__()  # whatever went wrong, never leave the node's ledger locked
            raise
        return self.data

    def __exit__(self, kind: object, *rest: object) -> None:
        try:
            if kind is None and jsonlite.dumps(self.data, sort_keys=True) != self.before:
                self.ledger._write(self.data)
                self.ledger._sync_claims(self.data)
        finally:
            self.lock.__exit__()


class Booking:
    def __init__(self, ledger: Ledger, container_id: str, new: bool) -> None:
        self.ledger = ledger
        self.container_id = container_id
        self.new = new

    def cancel(self) -> None:
        """The hook failed after booking: free what this invocation booked (nothing if it was a re-run)."""
        if self.new:
            with self.ledger.locked() as data:
                data["allocations"].pop(self.container_id, None)
                self.ledger.event("cancelled", container=self.container_id)


class Ledger:
    def __init__(self, state_dir: str, *, proc: str = "/proc", reclaim_timeout: float = RECLAIM_TIMEOUT,
                 profile_dirs: tuple[str, ...] = ()) -> None:
        self.state_dir = state_dir
        self.profile_dirs = profile_dirs  # where sharing modes come from, besides the shipped/admin profiles
        self.proc = proc
        self.reclaim_timeout = reclaim_timeout
        self.path = os.path.join(state_dir, LEDGER_FILE)
        self._pid_namespace: str | None = ""  # "": not looked up yet

    # --- storage -------------------------------------------------------------------------------------
    def locked(self) -> _Locked:
        """The ledger's contents under an exclusive lock; written back (atomically) on a clean exit."""
        return _Locked(self)

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            return {"allocations": {}}
        except OSError as err:
            raise LedgerError(f"{self.path}: cannot read the ledger: {err.strerror}") from None
        try:
            data = jsonlite.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            return self._rebuild(f"unreadable: {err}", raw)
        problem = ledger_problem(data)
        if problem:
            return self._rebuild(problem, raw)
        theirs, ours = data.get("pid_namespace"), self.pid_namespace()
        if theirs is not None and ours is not None and theirs != ours:
            # Its pids name other processes here: a booking would look dead (and its GPU free) or alive
            # through a stranger. One pid namespace per ledger, never a guess across two.
            raise ForeignLedgerError(f"{self.path}: the ledger counts pids of another pid namespace ({theirs}; this "
                              f"process is in {ours}): run in the node's pid namespace (hostPID) or give this "
                              "one a state dir of its own")
        checked: dict[str, Any] = data  # ledger_problem passed: the ledger's shape
        return checked

    def _rebuild(self, reason: str, raw: bytes) -> dict[str, Any]:
        """Keep the broken ledger aside and book what live evidence on the node shows in use — written at
        once, under the lock that found it broken: whatever the booking that got here decides (a refusal
        included), the next access reads the rebuilt ledger, and no moment exists in which ledger.json
        is missing and every device looks free."""
        from devinject.nodestate import evidence

        aside = f"{self.path}.broken-{time.time_ns()}"
        allocations: dict[str, Any] = self._kept_claims()  # no process shows a claim's devices in use
        now = time.time()
        for holding in evidence.collect(self.proc):
            started = process_start_time(holding.pid, self.proc)
            if started is not None:
                # own_pid_ns as for any booking: a recovered container that had one leaves nobody behind
                entry = allocations[f"recovered: {holding.source}"] = {
                    "devices": [], "exclusive": list(holding.nodes), "shared": [], "pid": holding.pid,
                    "start_time": started, "time": now, "state": "active", "recovered": True,
                    "own_pid_ns": has_own_pid_namespace(holding.pid, self.proc)}
                if holding.pod is not None:
                    entry["pod"] = holding.pod  # its pod's claim (booked again by the driver) is no clash
        for cid, claim in self._checkpointed_claims(allocations).items():  # the claims' copy lost too
            held = set(claim["exclusive"]) | set(claim["shared"])
            clash = [other for other, entry in allocations.items()
                     if entry.get("recovered") and not same_pod(claim, entry) and held & set(entry["exclusive"])]
            if clash:  # as the driver's own rebook would be: refused, and said
                self.event("claim-not-restored", container=cid, held_by=clash[0])
                continue
            allocations[cid] = claim
        rebuilt = {"allocations": allocations}
        try:
            atomicfile.replace(aside, raw, 0o600)  # forensics: the bytes as they were
        except OSError as err:
            raise LedgerError(f"{self.path}: broken ledger ({reason}) and cannot keep it aside: "
                              f"{err.strerror}") from None
        self._write(rebuilt)  # over the broken file, in one rename
        self._sync_claims(rebuilt)
        self.event("ledger-rebuilt", reason=reason, moved_to=aside, bookings=len(allocations))
        return rebuilt

    def pid_namespace(self) -> str | None:
        """This process's pid namespace (`dev:inode`), which every pid in the ledger belongs to; None when
        `proc` does not show it (a fixture tree)."""
        if self._pid_namespace == "":
            try:
                st = os.stat(f"{self.proc}/self/ns/pid")
                self._pid_namespace = f"{st.st_dev}:{st.st_ino}"
            except OSError:
                self._pid_namespace = None
        return self._pid_namespace

    def _kept_claims(self) -> dict[str, Any]:
        """The claims' bookings as the ledger last held them (CLAIMS_FILE); none when that file is missing or
        broken too (the DRA driver books its checkpointed claims again on its next round)."""
        path = os.path.join(self.state_dir, CLAIMS_FILE)
        try:
            with open(path, "rb") as handle:
                claims = jsonlite.loads(handle.read().decode("utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, UnicodeDecodeError) as err:
            self.event("claims-unreadable", path=path, reason=str(err))
            return {}
        if not isinstance(claims, dict) or ledger_problem({"allocations": claims}) is not None \
                or not all("pods" in entry for entry in claims.values()):
            self.event("claims-unreadable", path=path, reason="not the claims' bookings")
            return {}
        return claims

    def _checkpointed_claims(self, kept: dict[str, Any]) -> dict[str, Any]:
        """The claims the DRA drivers' checkpoints hold that `kept` lacks, booked as the driver books them (for
        the node, pid 1, for their pods): with the ledger and its claims' copy both lost, a claim prepared for
        a pod that has not started would otherwise look free, and a process in no pod could take its GPU."""
        from devinject.nodestate.claimcheckpoints import NODE_PID, checkpointed_bookings, checkpointed_consumes
        from devinject.nodestate.profilefacts import sharing_policy

        bookings, pods, unreadable = checkpointed_bookings(self.state_dir)
        for name in unreadable:
            self.event("checkpoint-unreadable", path=os.path.join(self.state_dir, name))
        missing = {cid: booked for cid, booked in bookings.items() if cid not in kept}
        started = process_start_time(NODE_PID, self.proc)
        if not missing or started is None:
            return {}
        policy = sharing_policy(self.state_dir, profile_dirs=self.profile_dirs)
        shares = checkpointed_consumes(self.state_dir)
        out: dict[str, Any] = {}
        now = time.time()
        for cid, booked in missing.items():
            exclusive: set[str] = set()
            shared: set[str] = set()
            for name, nodes, shared_nodes in booked:
                if policy.get(name.partition("=")[0], "exclusive") == "shared":
                    shared.update(nodes)
                else:
                    shared.update(shared_nodes)
                    exclusive.update(n for n in nodes if n not in shared_nodes)
            out[cid] = {"devices": [b[0] for b in booked], "exclusive": sorted(exclusive), "shared": sorted(shared),
                        "pid": NODE_PID, "start_time": started, "time": now, "state": "active",
                        "own_pid_ns": has_own_pid_namespace(NODE_PID, self.proc), "pods": sorted(set(pods[cid]))}
            if shares.get(cid):  # consumable-capacity shares: shared, their amounts counted again
                out[cid].update(consumes=shares[cid], shared=sorted(exclusive | shared), exclusive=[])
        return out

    def _sync_claims(self, data: dict[str, Any]) -> None:
        """CLAIMS_FILE made to hold the ledger's claims' bookings, after the ledger is written: compared with the
        file itself, not with what the ledger held before, so a write that failed once (the ledger then says
        one thing and the copy another) is made good by the next, and a released claim never comes back from
        a stale copy in a rebuild. Nothing is written on a node without claims."""
        claims = claim_bookings(data)
        path = os.path.join(self.state_dir, CLAIMS_FILE)
        wanted = jsonlite.dumps(claims, sort_keys=True).encode()
        try:
            with open(path, "rb") as handle:
                if handle.read() == wanted:
                    return
        except FileNotFoundError:
            if not claims:
                return
        except OSError:
            pass
        try:
            atomicfile.replace(path, wanted)
        except OSError as err:
            raise LedgerError(f"{path}: cannot write the claims' bookings: {err.strerror}") from None

    def _write(self, data: dict[str, Any]) -> None:
        data["version"] = LEDGER_VERSION
        namespace = self.pid_namespace()
        if namespace is not None:
            data["pid_namespace"] = namespace
        try:
            # rename is atomic: a crash of any process leaves the old or the new ledger, never half of one.
            # No fsync: the ledger lives on /run (tmpfs) and describes processes that a reboot ends anyway.
            jsonlite.replace_file(self.path, data, sort_keys=True)
        except OSError as err:
            raise LedgerError(f"{self.path}: cannot write the ledger: {err.strerror}") from None

    def event(self, kind: str, **fields: Any) -> None:
        try:
            events.record(self.state_dir, kind, **fields)
        except OSError:
            pass  # the event log is a record, not a reason to fail a container

    # --- housekeeping --------------------------------------------------------------------------------
    def _alive(self, entry: dict[str, Any]) -> bool:
        started = process_start_time(int(entry.get("pid", 0)), self.proc)
        return started is not None and started == entry.get("start_time")

    def reclaim(self, data: dict[str, Any], wanted: set[str] | None = None) -> None:
        """Drop allocations of dead containers; finish releases whose nodes nobody holds any more.

        Finishing a release needs a /proc/*/fd scan, so it is done only for releases that hold one of the
        `wanted` nodes, exclusive or shared (a booking's; None: all of them, for `list` and `who`), in one
        scan; none happens when nothing is in the way. Poststop therefore costs no scan at all.
        """
        allocations = data["allocations"]
        for cid, entry in allocations.items():
            if entry.get("state") != "reclaiming" and not self._alive(entry):
                entry["state"] = "reclaiming"
                entry["released_at"] = time.time()
                self.event("container-gone", container=cid, devices=entry.get("devices"))
        releasing = {cid: e for cid, e in allocations.items() if e.get("state") == "reclaiming"
                     and (wanted is None or wanted & set(e["exclusive"] + e.get("shared", [])))}
        for cid, entry in list(releasing.items()):
            # A container with a pid namespace of its own leaves nobody behind: the kernel ends every other
            # process of the namespace before its init's exit completes. No scan for it.
            if entry.get("own_pid_ns") and not self._alive(entry):
                del allocations[cid], releasing[cid]
                self.event("released", container=cid, devices=entry.get("devices"))
        if not releasing:
            return
        held = holders_of({n for e in releasing.values() for n in e.get("exclusive", [])}, self.proc,
                          containers_only=True)
        for cid, entry in releasing.items():
            mine = {n: pids for n, pids in held.items() if n in entry.get("exclusive", [])}
            if not mine:
                del allocations[cid]
                self.event("released", container=cid, devices=entry.get("devices"))
            elif time.time() - float(entry.get("released_at", 0)) > self.reclaim_timeout:
                del allocations[cid]
                self.event("reclaim-timeout", container=cid, devices=entry.get("devices"), holders=mine)

    def _unhealthy_nodes(self) -> set[str]:
        """The nodes the node agent took out. No health.json: no agent runs, nothing is out. One that cannot
        be read refuses the booking: taking it as "all healthy" would hand out a failing device."""
        path = healthverdicts.health_path(self.state_dir)
        try:
            verdicts = healthverdicts.read(self.state_dir)
        except UnreadableStateFile as err:
            raise LedgerError(err.message) from None
        except StateFileError as err:
            raise LedgerError(f"{path}: not a devinject health file ({problem_in(err, path)}); no device allocated "
                              "until the node agent rewrites it") from None
        return set() if verdicts is None else set(verdicts.unhealthy_nodes)

    # --- the operations ------------------------------------------------------------------------------
    def book(self, container_id: str, pid: int, claims: tuple[Claim, ...],
             policy: dict[str, str] | None = None, *, for_pods: tuple[str, ...] | None = None,
             consumes: Consumes | None = None) -> Booking:
        """Record `container_id`'s devices; refuse an exclusive device another live container holds.

        A container's booking records its pod (its cgroup says; nothing the container says counts). A DRA
        claim's booking gives `for_pods`, the pods the claim is reserved for: it and a booking of one of
        those pods' containers do not clash, either way round; anything else does. `consumes`: the nodes a
        claim holds as consumable-capacity shares (node -> capacity -> [amount, total]): booked shared, beside
        other shares only, and never beyond the device's total (capacity_clash, capacity_left)."""
        if policy is None:
            from devinject.nodestate.profilefacts import sharing_policy

            policy = sharing_policy(self.state_dir, profile_dirs=self.profile_dirs, containers=for_pods is None)
        names = tuple(claim.name for claim in claims)
        exclusive: list[str] = []
        shared: list[str] = []
        shared_kind: set[str] = set()  # nodes of kinds that share every device: a recovered holding is no clash
        for claim in claims:
            mode = policy.get(claim.name.partition("=")[0], "exclusive")
            if mode == "shared":
                shared.extend(claim.nodes)
                shared_kind.update(claim.nodes)
            else:  # `claim.shared`: nodes of an exclusive claim that others may hold too (a MIG parent GPU)
                shared.extend(claim.shared)
                exclusive.extend(n for n in claim.nodes if n not in claim.shared)
        consumes = {n: {k: list(v) for k, v in caps.items()} for n, caps in (consumes or {}).items()}
        for node, caps in consumes.items():  # a share of nothing would never fill the device
            for cap, (amount, total) in caps.items():
                if not 0 < amount <= total:
                    raise LedgerError(f"device {node}: a {cap} share of {amount} (of {total}) cannot be booked; "
                                      "refused")
        if consumes:  # a capacity share is shared whatever the kind's policy, its amounts counted
            shared.extend(exclusive)
            exclusive = []
            shared_kind.update(consumes)  # evidence of a container on it may be one of its pods'
        exclusive = sorted(set(exclusive))
        trusted_dir(self.state_dir, error=LedgerError)  # health.json is read before the lock checks it
        unhealthy = self._unhealthy_nodes() & set(exclusive + shared)
        if unhealthy:
            raise LedgerError(f"container {container_id}: device node {sorted(unhealthy)[0]} is unhealthy; "
                              "not allocated")
        start_time = process_start_time(pid, self.proc)
        if start_time is None:
            raise LedgerError(f"container {container_id}: process {pid} is gone")
        pods: dict[str, Any] = {"pods": sorted(set(for_pods))} if for_pods is not None else {}
        if for_pods is None:
            from devinject.nodestate.podcgroup import pod_of

            pod = pod_of(pid, self.proc)
            if process_start_time(pid, self.proc) != start_time:  # the pod read is of the process booked
                raise LedgerError(f"container {container_id}: process {pid} is gone")
            if pod is not None:
                pods["pod"] = pod
        with self.locked() as data:
            self.reclaim(data, wanted=set(exclusive) | set(shared))  # what could clash: held either way
            allocations = data["allocations"]
            existing = allocations.get(container_id)
            if existing is not None:
                if (existing["pid"], existing["start_time"]) == (pid, start_time):
                    existing.update(pods)  # a claim's consumers as now known
                    return Booking(self, container_id, new=False)  # the hook ran again for this container
                if existing["state"] != "reclaiming":
                    raise LedgerError(f"container {container_id}: the id is booked for another live process "
                                      f"(pid {existing['pid']}); refusing a second container with the same id")
                # A new container reusing a dead one's id: the old booking stays until its nodes are free.
                allocations[f"{container_id}@{existing['start_time']}"] = allocations.pop(container_id)
            booking: dict[str, Any] = {"devices": list(names), "exclusive": exclusive, "shared": sorted(set(shared)),
                                       "pid": pid, "start_time": start_time, "time": time.time(),
                                       "state": "active", "own_pid_ns": has_own_pid_namespace(pid, self.proc),
                                       **pods, **({"consumes": consumes} if consumes else {})}
            if for_pods is None:
                self._time_slices_left(container_id, claims, allocations)
            # the claims reserved for this container's pod: their devices are shared by their pods' containers
            our_claims = [entry for entry in allocations.values() if booking.get("pod") in entry.get("pods", ())]
            # a container of a pod whose claim holds a consumable-capacity share rides on that share
            riding = {n for reserved in our_claims for n in (reserved.get("consumes") or {})}
            if riding & set(exclusive):  # a share is not the container's alone: other pods' shares ride it too
                exclusive = [n for n in exclusive if n not in riding]
                shared = sorted(set(shared) | (riding & set(booking["exclusive"])))
                booking.update(exclusive=exclusive, shared=shared)
            for other_id, entry in allocations.items():
                if entry.get("recovered") and entry["pid"] == pid:
                    continue  # evidence of this very container from an earlier run of its hook
                if same_pod(booking, entry):
                    continue  # a claim and a container of a pod it is reserved for
                if for_pods is None and is_plugin(entry):
                    continue  # the kubelet's accounting keeps its own pods apart: the hook books their containers
                # exclusive against anything held; shared against what another holds exclusively
                clash = (set(exclusive) & set(entry["exclusive"] + entry.get("shared", []))
                         | set(shared) & set(entry["exclusive"]))
                if entry.get("recovered"):  # evidence names nodes, not how their kind shares them
                    clash -= shared_kind
                for reserved in our_claims:  # two containers of a claim's pods, on the devices it holds for both
                    if entry.get("pod") in reserved["pods"]:
                        clash -= set(reserved["exclusive"])  # not what it shares with others (a MIG parent)
                if entry.get("consumes"):
                    clash -= riding
                if clash:
                    raise LedgerError(f"{', '.join(names)}: device {sorted(clash)[0]} is held by "
                                      f"{describe(other_id, entry)}")
                capacity = None if entry.get("recovered") else \
                    capacity_clash((set(exclusive) | set(shared)) - riding, consumes, entry)
                if capacity is not None:
                    raise LedgerError(f"{', '.join(names)}: device {capacity[0]} is {capacity[1]} by "
                                      f"{describe(other_id, entry)}")
            left = capacity_left(consumes, allocations, container_id)
            if left is not None:
                raise LedgerError(f"{', '.join(names)}: {left}")
            allocations[container_id] = booking
            self.event("allocated", container=container_id, devices=list(names))
        return Booking(self, container_id, new=True)

    def _time_slices_left(self, container_id: str, claims: tuple[Claim, ...],
                          allocations: dict[str, Any]) -> None:
        """A device the device plugin time-slices N ways is held by at most N containers (the kubelet hands out
        N replicas; a container started outside its accounting is one too many)."""
        from devinject.nodestate.profilefacts import time_slicing

        sliced = time_slicing(self.state_dir)
        for claim in claims:
            replicas = sliced.get(claim.name.partition("=")[0])
            if replicas is None or not claim.nodes:
                continue
            node = claim.nodes[0]  # the device's own node (a GPU's /dev/nvidiaN)
            holders = sorted(cid for cid, entry in allocations.items()
                             if cid != container_id and "pods" not in entry and entry.get("state") == "active"
                             and node in entry.get("shared", []) + entry.get("exclusive", []))
            if len(holders) >= replicas:
                raise LedgerError(f"{claim.name}: time-sliced {replicas} ways and held by {len(holders)} "
                                  f"containers already ({', '.join(holders[:4])}{', ...' if len(holders) > 4 else ''})")

    def book_plugin(self, resource: str, devices: dict[str, Claim], pods: dict[str, list[str]] | None = None,
                    policy: dict[str, str] | None = None) -> list[str]:
        """The device plugin's Allocate: book each device the kubelet gives a pod (device ID -> its nodes) for
        the node (pid 1), all or none, as `device-plugin:<resource>:<ID>` (`plugin`: the resource; `pods`: the
        pod, once the kubelet's checkpoint names it). Refused: a device a DRA claim or another of the plugin's
        bookings holds, or an unhealthy one. Containers' bookings (the hook's) are no clash either way: they
        are the pods' own containers, and the kubelet keeps its pods apart. A device of this resource booked
        before is replaced (the kubelet gives a device again only when its accounting freed it); given `pods`
        (a rebook from the kubelet's checkpoint), a booking there already only learns its pods. The IDs newly
        booked."""
        if policy is None:
            from devinject.nodestate.profilefacts import sharing_policy

            policy = sharing_policy(self.state_dir, profile_dirs=self.profile_dirs)
        wanted: dict[str, tuple[Claim, list[str], list[str]]] = {}
        for device_id, claim in devices.items():
            nodes, sharing = {str(n) for n in claim.nodes}, {str(n) for n in claim.shared}
            if policy.get(claim.name.partition("=")[0], "exclusive") == "shared":
                nodes, sharing = set(), nodes
            wanted[plugin_booking_id(resource, device_id)] = (claim, sorted(nodes - sharing), sorted(sharing))
        every = {n for _, ex, sh in wanted.values() for n in ex + sh}
        trusted_dir(self.state_dir, error=LedgerError)
        unhealthy = self._unhealthy_nodes() & every
        if unhealthy:
            raise LedgerError(f"{resource}: device node {sorted(unhealthy)[0]} is unhealthy; not allocated")
        start_time = process_start_time(1, self.proc)
        if start_time is None:
            raise LedgerError(f"{self.proc}/1: the node's init is not visible; not allocated")
        booked: list[str] = []
        with self.locked() as data:
            self.reclaim(data, wanted=every)
            allocations = data["allocations"]
            for booking_id, (claim, exclusive, shared) in wanted.items():
                existing = allocations.get(booking_id)
                if pods is not None and existing is not None:
                    continue  # known: only its pods are learned, below
                for other_id, entry in allocations.items():
                    if other_id in wanted or "pods" not in entry:
                        continue  # this request's own devices; a container's booking
                    clash = clashes(exclusive, shared, (set(entry["exclusive"]), set(entry.get("shared", []))))
                    clash |= {c[0] for c in [capacity_clash(set(exclusive) | set(shared), {}, entry)] if c}
                    if clash:
                        raise LedgerError(f"{claim.name} ({resource} device {plugin_device_id(booking_id)}): "
                                          f"device {sorted(clash)[0]} is held by {describe(other_id, entry)}")
            for booking_id, (claim, exclusive, shared) in wanted.items():
                device_id = plugin_device_id(booking_id)
                existing = allocations.get(booking_id)
                if pods is not None and existing is not None:
                    existing["pods"] = sorted(set(existing.get("pods", [])) | set(pods.get(device_id, [])))
                    continue
                allocations[booking_id] = {
                    "devices": [claim.name], "exclusive": exclusive, "shared": shared, "pid": 1,
                    "start_time": start_time, "time": time.time(), "state": "active", "own_pid_ns": False,
                    "plugin": resource, "pods": sorted(set((pods or {}).get(device_id, [])))}
                booked.append(device_id)
                self.event("allocated", container=booking_id, devices=[claim.name])
        return booked

    def plugin_update(self, pods: dict[str, list[str]], released: Iterable[str] = ()) -> None:
        """The device plugin's round: the pods its bookings (by booking ID) were given to, as the kubelet's
        checkpoint says, and the bookings whose pods are gone (freed at once: a pod's directory goes after
        its containers have ended)."""
        with self.locked() as data:
            allocations = data["allocations"]
            for booking_id in released:
                entry = allocations.get(booking_id)
                if entry is not None and is_plugin(entry):
                    del allocations[booking_id]
                    self.event("released", container=booking_id, devices=entry.get("devices"))
            for booking_id, known in pods.items():
                entry = allocations.get(booking_id)
                if entry is not None and is_plugin(entry) and sorted(set(known)) != entry.get("pods"):
                    entry["pods"] = sorted(set(known))

    def read(self) -> dict[str, Any] | None:
        """The ledger as it is now, without the lock or any housekeeping (its file is replaced whole, so a read
        sees one version): for offers that follow it every second. None when it is missing or broken: no word
        on what is held (the next booking rebuilds it, and the agents book theirs again)."""
        try:
            with open(self.path, "rb") as handle:
                data = jsonlite.loads(handle.read().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return data if ledger_problem(data) is None else None

    def release(self, container_id: str) -> str:
        """poststop: idempotent and quick. The booking ends here; its nodes are free once no container's
        process holds them open, which the next access checks (a booking that wants them, `watch`'s sweep,
        `list`): no scan of /proc, and no process left behind, on the runtime's delete path."""
        if not os.path.exists(self.path):
            return "not allocated"  # nothing was ever booked: touch nothing
        with self.locked() as data:
            entry = data["allocations"].get(container_id)
            if entry is None:
                return "not allocated"
            if entry["state"] == "reclaiming":
                return "already released"  # poststop ran before (or the container was found dead)
            entry["state"] = "reclaiming"
            entry["released_at"] = time.time()
            self.event("poststop", container=container_id, devices=entry["devices"])
            self.reclaim(data, wanted=set())
        return "released"

    def sweep(self) -> bool:
        """Free what dead containers held (the node agent, every round): the hook runs no poststop by
        default, and a booking should find the devices it wants already free, not pay for the scan. False
        when the ledger counts another pid namespace's pids (an agent pod without hostPID): the sweep only
        saves the next booking a scan, so it is left to the hooks, which reclaim on every booking."""
        if not os.path.exists(self.path):
            return True  # nothing was ever booked: create nothing
        try:
            with self.locked() as data:
                self.reclaim(data)
        except ForeignLedgerError:
            return False
        return True

    def entries(self) -> dict[str, LedgerEntry]:
        """Every booking by its id, after the housekeeping `snapshot` does, as records: what `list` and
        `who` show. None booked (and nothing created) where no ledger was ever written."""
        if not os.path.exists(self.path):
            return {}
        return {cid: LedgerEntry.from_json(entry) for cid, entry in self.snapshot()["allocations"].items()}

    def snapshot(self) -> dict[str, Any]:
        with self.locked() as data:
            self.reclaim(data)
            copy: dict[str, Any] = jsonlite.loads(jsonlite.dumps(data))
            return copy
