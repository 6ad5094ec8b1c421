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
from devinject.nodestate.clashrule import plan_booking, plan_plugin_booking, plugin_device_id, same_pod
from devinject.nodestate.ledgerrecords import LEDGER_VERSION as LEDGER_VERSION  # the ledger's names, as before
from devinject.nodestate.ledgerrecords import LedgerEntry as LedgerEntry
from devinject.nodestate.ledgerrecords import LedgerFile, allocations_json, ledger_problem
from devinject.nodestate.statefile import StateFileError, UnreadableStateFile, problem_in

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Mapping
    from typing import Any, NamedTuple

    from devinject.cdi.identity import NodeId, QualifiedName
    from devinject.nodestate.ledgerrecords import Consumes
else:
    from devinject.core.records import NamedTuple


LEDGER_FILE = "ledger.json"
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
    return LedgerFile.from_json(data).allocations


class ForeignLedgerError(LedgerError):
    """The ledger's pids belong to another pid namespace than this process's."""


class Claim(NamedTuple):
    """One requested device and the identities of its nodes (`c 195:0`). `shared` names nodes of it that
    other containers may hold at the same time (those its kinds share, in a bundle; the parent GPU of a MIG
    device); the rest are booked as the kind's policy says."""
    name: QualifiedName | str
    nodes: tuple[NodeId, ...]
    shared: tuple[NodeId, ...] = ()


def claim_bookings(allocations: Mapping[str, LedgerEntry]) -> dict[str, LedgerEntry]:
    """The bookings held for pods rather than for a process: DRA claims' (`pods`, the pods a claim is reserved
    for) and the device plugin's (`plugin`, its resource; `pods`, the pod the kubelet gave the device to, once
    known). No live evidence shows them when a lost ledger is rebuilt (a pod's containers may not run yet);
    kept in CLAIMS_FILE as well."""
    return {name: entry for name, entry in allocations.items() if entry.pods is not None}


PLUGIN_PREFIX = "device-plugin:"  # the device plugin's bookings: device-plugin:<resource>:<device ID>


def plugin_booking_id(resource: str, device_id: str) -> str:
    return f"{PLUGIN_PREFIX}{resource}:{device_id}"


def is_plugin(entry: LedgerEntry) -> bool:
    """A booking the device plugin made in Allocate: a device the kubelet gave a pod."""
    return entry.plugin is not None


def is_claim(entry: LedgerEntry) -> bool:
    """A DRA claim's booking (held for the pods it is reserved for)."""
    return entry.pods is not None and entry.plugin is None


def held_nodes(allocations: Mapping[str, LedgerEntry],
               which: Callable[[LedgerEntry], bool]) -> tuple[set[str], set[str]]:
    """The nodes the bookings `which` picks hold: (exclusive, shared)."""
    exclusive: set[str] = set()
    shared: set[str] = set()
    for entry in allocations.values():
        if which(entry):  # reclaiming too: a booking refuses them until their holders are gone
            exclusive.update(entry.exclusive)
            shared.update(entry.shared)
    return exclusive, shared


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
    """`with ledger.locked() as allocations:` (a class, not contextlib: see filelock): the bookings by id,
    a dict to change in place (its records are replaced, never changed), written back if it changed."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.lock = exclusive(os.path.join(ledger.state_dir, LOCK_FILE), timeout=LOCK_TIMEOUT, what="ledger",
                              error=LedgerError)
        self.file = LedgerFile({})
        self.before: dict[str, LedgerEntry] = {}

    def __enter__(self) -> dict[str, LedgerEntry]:
        self.lock.__enter__()
        try:
            self.file = self.ledger._read()
            self.before = dict(self.file.allocations)
        except BaseException:
            self.lock.__exit__()  # whatever went wrong, never leave the node's ledger locked
            raise
        return self.file.allocations

    def __exit__(self, kind: object, *rest: object) -> None:
        try:
            if kind is None and self.file.allocations != self.before:
                self.ledger._write(self.file)
                self.ledger._sync_claims(self.file.allocations)
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
            with self.ledger.locked() as allocations:
                allocations.pop(self.container_id, None)
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
        """The ledger's bookings under an exclusive lock; written back (atomically) on a clean exit."""
        return _Locked(self)

    def _read(self) -> LedgerFile:
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            return LedgerFile({})
        except OSError as err:
            raise LedgerError(f"{self.path}: cannot read the ledger: {err.strerror}") from None
        try:
            data = jsonlite.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            return self._rebuild(f"unreadable: {err}", raw)
        problem = ledger_problem(data)
        if problem:
            return self._rebuild(problem, raw)
        read = LedgerFile.from_json(data)
        theirs, ours = read.pid_namespace, self.pid_namespace()
        if theirs is not None and ours is not None and theirs != ours:
            # Its pids name other processes here: a booking would look dead (and its GPU free) or alive
            # through a stranger. One pid namespace per ledger, never a guess across two.
            raise ForeignLedgerError(f"{self.path}: the ledger counts pids of another pid namespace ({theirs}; this "
                              f"process is in {ours}): run in the node's pid namespace (hostPID) or give this "
                              "one a state dir of its own")
        return read

    def _rebuild(self, reason: str, raw: bytes) -> LedgerFile:
        """Keep the broken ledger aside and book what live evidence on the node shows in use — written at
        once, under the lock that found it broken: whatever the booking that got here decides (a refusal
        included), the next access reads the rebuilt ledger, and no moment exists in which ledger.json
        is missing and every device looks free."""
        from devinject.nodestate import evidence

        aside = f"{self.path}.broken-{time.time_ns()}"
        allocations = self._kept_claims()  # no process shows a claim's devices in use
        now = time.time()
        for holding in evidence.collect(self.proc):
            started = process_start_time(holding.pid, self.proc)
            if started is not None:
                # own_pid_ns as for any booking: a recovered container that had one leaves nobody behind;
                # its pod's claim (booked again by the driver) is no clash
                allocations[f"recovered: {holding.source}"] = LedgerEntry(
                    (), tuple(holding.nodes), (), holding.pid, started, "active", now,
                    has_own_pid_namespace(holding.pid, self.proc), pod=holding.pod, recovered=True)
        for cid, claim in self._checkpointed_claims(allocations).items():  # the claims' copy lost too
            clash = [other for other, entry in allocations.items()
                     if entry.recovered and not same_pod(claim, entry) and claim.nodes & set(entry.exclusive)]
            if clash:  # as the driver's own rebook would be: refused, and said
                self.event("claim-not-restored", container=cid, held_by=clash[0])
                continue
            allocations[cid] = claim
        rebuilt = LedgerFile(allocations)
        try:
            atomicfile.replace(aside, raw, 0o600)  # forensics: the bytes as they were
        except OSError as err:
            raise LedgerError(f"{self.path}: broken ledger ({reason}) and cannot keep it aside: "
                              f"{err.strerror}") from None
        self._write(rebuilt)  # over the broken file, in one rename
        self._sync_claims(allocations)
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

    def _kept_claims(self) -> dict[str, LedgerEntry]:
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
        return LedgerFile.from_json({"allocations": claims}).allocations

    def _checkpointed_claims(self, kept: Mapping[str, LedgerEntry]) -> dict[str, LedgerEntry]:
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
        own_pid_ns = has_own_pid_namespace(NODE_PID, self.proc)
        out: dict[str, LedgerEntry] = {}
        now = time.time()
        for cid, booked in missing.items():
            exclusive, shared = split_claims(booked, policy)
            out[cid] = LedgerEntry(tuple(b[0] for b in booked), tuple(sorted(exclusive)), tuple(sorted(shared)),
                                   NODE_PID, started, "active", now, own_pid_ns, pods=tuple(sorted(set(pods[cid]))))
            if shares.get(cid):  # consumable-capacity shares: shared, their amounts counted again
                out[cid] = out[cid]._replace(consumes=shares[cid], shared=tuple(sorted(exclusive | shared)),
                                             exclusive=())
        return out

    def _sync_claims(self, allocations: Mapping[str, LedgerEntry]) -> None:
        """CLAIMS_FILE made to hold the ledger's claims' bookings, after the ledger is written: compared with the
        file itself, not with what the ledger held before, so a write that failed once (the ledger then says
        one thing and the copy another) is made good by the next, and a released claim never comes back from
        a stale copy in a rebuild. Nothing is written on a node without claims."""
        claims = claim_bookings(allocations)
        path = os.path.join(self.state_dir, CLAIMS_FILE)
        wanted = jsonlite.dumps(allocations_json(claims), sort_keys=True).encode()
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

    def _write(self, ledger: LedgerFile) -> None:
        namespace = self.pid_namespace()
        if namespace is not None:
            ledger = ledger._replace(pid_namespace=namespace)
        try:
            # rename is atomic: a crash of any process leaves the old or the new ledger, never half of one.
            # No fsync: the ledger lives on /run (tmpfs) and describes processes that a reboot ends anyway.
            jsonlite.replace_file(self.path, ledger.to_json(), sort_keys=True)
        except OSError as err:
            raise LedgerError(f"{self.path}: cannot write the ledger: {err.strerror}") from None

    def event(self, kind: str, **fields: Any) -> None:
        try:
            events.record(self.state_dir, kind, **fields)
        except OSError:
            pass  # the event log is a record, not a reason to fail a container

    # --- housekeeping --------------------------------------------------------------------------------
    def _alive(self, entry: LedgerEntry) -> bool:
        started = process_start_time(entry.pid, self.proc)
        return started is not None and started == entry.start_time

    def reclaim(self, allocations: dict[str, LedgerEntry], wanted: set[str] | None = None) -> None:
        """Drop allocations of dead containers; finish releases whose nodes nobody holds any more.

        Finishing a release needs a /proc/*/fd scan, so it is done only for releases that hold one of the
        `wanted` nodes, exclusive or shared (a booking's; None: all of them, for `list` and `who`), in one
        scan; none happens when nothing is in the way. Poststop therefore costs no scan at all.
        """
        for cid, entry in list(allocations.items()):
            if entry.state != "reclaiming" and not self._alive(entry):
                allocations[cid] = entry._replace(state="reclaiming", released_at=time.time())
                self.event("container-gone", container=cid, devices=list(entry.devices))
        releasing = {cid: e for cid, e in allocations.items() if e.state == "reclaiming"
                     and (wanted is None or wanted & e.nodes)}
        for cid, entry in list(releasing.items()):
            # A container with a pid namespace of its own leaves nobody behind: the kernel ends every other
            # process of the namespace before its init's exit completes. No scan for it.
            if entry.own_pid_ns and not self._alive(entry):
                del allocations[cid], releasing[cid]
                self.event("released", container=cid, devices=list(entry.devices))
        if not releasing:
            return
        held = holders_of({n for e in releasing.values() for n in e.exclusive}, self.proc, containers_only=True)
        for cid, entry in releasing.items():
            mine = {n: pids for n, pids in held.items() if n in entry.exclusive}
            if not mine:
                del allocations[cid]
                self.event("released", container=cid, devices=list(entry.devices))
            elif time.time() - (entry.released_at or 0) > self.reclaim_timeout:
                del allocations[cid]
                self.event("reclaim-timeout", container=cid, devices=list(entry.devices), holders=mine)

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

    def _usable(self, what: str, nodes: set[str]) -> None:
        """LedgerError unless `nodes` may be booked at all: the state dir trusted, none of them unhealthy."""
        trusted_dir(self.state_dir, error=LedgerError)  # health.json is read before the lock checks it
        unhealthy = self._unhealthy_nodes() & nodes
        if unhealthy:
            raise LedgerError(f"{what}: device node {sorted(unhealthy)[0]} is unhealthy; not allocated")

    # --- the operations ------------------------------------------------------------------------------
    def book(self, container_id: str, pid: int, claims: tuple[Claim, ...],
             policy: dict[str, str] | None = None, *, for_pods: tuple[str, ...] | None = None,
             consumes: Consumes | None = None) -> Booking:
        """Record `container_id`'s devices; refuse an exclusive device another live container holds.

        A container's booking records its pod (its cgroup says; nothing the container says counts). A DRA
        claim's booking gives `for_pods`, the pods the claim is reserved for: it and a booking of one of
        those pods' containers do not clash, either way round; anything else does. `consumes`: the nodes a
        claim holds as consumable-capacity shares (node -> capacity -> [amount, total]): booked shared, beside
        other shares only, and never beyond the device's total (clashrule.py has the rule)."""
        if policy is None:
            from devinject.nodestate.profilefacts import sharing_policy

            policy = sharing_policy(self.state_dir, profile_dirs=self.profile_dirs, containers=for_pods is None)
        booking, shared_kind = self._booking_of(container_id, pid, claims, policy, for_pods, consumes)
        time_sliced = self._time_sliced(claims) if for_pods is None else None
        with self.locked() as allocations:
            self.reclaim(allocations, wanted=booking.nodes)  # what could clash: held either way
            planned, new = plan_booking(allocations, container_id, booking._replace(time=time.time()),
                                        shared_kind=shared_kind, time_sliced=time_sliced)
            allocations.clear()
            allocations.update(planned)
            if new:
                self.event("allocated", container=container_id, devices=list(booking.devices))
        return Booking(self, container_id, new=new)

    def _booking_of(self, container_id: str, pid: int, claims: tuple[Claim, ...], policy: Mapping[str, str],
                    for_pods: tuple[str, ...] | None,
                    consumes: Consumes | None) -> tuple[LedgerEntry, frozenset[str]]:
        """The booking `book` asks for (its time still to be set), with the nodes of kinds that share every
        device: its facts (health, the process's start time and pod) read before the ledger is locked."""
        exclusive, shared = split_claims(claims, policy)
        # nodes of kinds that share every device: a recovered holding on them is no clash
        shared_kind = {str(n) for c in claims if policy.get(c.name.partition("=")[0], "exclusive") == "shared"
                       for n in c.nodes}
        consumes = checked_consumes(consumes or {})
        if consumes:  # a capacity share is shared whatever the kind's policy, its amounts counted
            exclusive, shared = set(), shared | exclusive
            shared_kind.update(consumes)  # evidence of a container on it may be one of its pods'
        self._usable(f"container {container_id}", exclusive | shared)
        start_time = process_start_time(pid, self.proc)
        if start_time is None:
            raise LedgerError(f"container {container_id}: process {pid} is gone")
        pod = None
        if for_pods is None:
            from devinject.nodestate.podcgroup import pod_of

            pod = pod_of(pid, self.proc)
            if process_start_time(pid, self.proc) != start_time:  # the pod read is of the process booked
                raise LedgerError(f"container {container_id}: process {pid} is gone")
        booking = LedgerEntry(tuple(str(c.name) for c in claims), tuple(sorted(exclusive)), tuple(sorted(shared)), pid,
                              start_time, "active", 0.0, has_own_pid_namespace(pid, self.proc), pod=pod,
                              pods=None if for_pods is None else tuple(sorted(set(for_pods))),
                              consumes=consumes or None)
        return booking, frozenset(shared_kind)

    def _time_sliced(self, claims: tuple[Claim, ...]) -> dict[str, tuple[int, str]]:
        """Claim name -> (the ways its kind is time-sliced, its device's own node) for the time-sliced claims
        of a container (clashrule.time_slices_left)."""
        from devinject.nodestate.profilefacts import time_slicing

        sliced = time_slicing(self.state_dir)
        return {str(claim.name): (sliced[kind], str(claim.nodes[0])) for claim in claims
                if (kind := claim.name.partition("=")[0]) in sliced and claim.nodes}

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
        wanted: dict[str, LedgerEntry] = {}
        for device_id, claim in devices.items():
            exclusive, shared = split_claims((claim,), policy)
            wanted[plugin_booking_id(resource, device_id)] = LedgerEntry(
                (str(claim.name),), tuple(sorted(exclusive)), tuple(sorted(shared)), 1, 0, plugin=resource,
                pods=tuple(sorted(set((pods or {}).get(device_id, [])))))
        every = {n for entry in wanted.values() for n in entry.nodes}
        self._usable(resource, every)
        start_time = process_start_time(1, self.proc)
        if start_time is None:
            raise LedgerError(f"{self.proc}/1: the node's init is not visible; not allocated")
        learned = None if pods is None else \
            {plugin_booking_id(resource, device_id): tuple(known) for device_id, known in pods.items()}
        with self.locked() as allocations:
            self.reclaim(allocations, wanted=every)
            now = time.time()
            planned, booked = plan_plugin_booking(
                allocations, {bid: e._replace(start_time=start_time, time=now) for bid, e in wanted.items()}, learned)
            allocations.clear()
            allocations.update(planned)
            for booking_id in booked:
                self.event("allocated", container=booking_id, devices=list(planned[booking_id].devices))
        return [plugin_device_id(booking_id) for booking_id in booked]

    def plugin_update(self, pods: dict[str, list[str]], released: Iterable[str] = ()) -> None:
        """The device plugin's round: the pods its bookings (by booking ID) were given to, as the kubelet's
        checkpoint says, and the bookings whose pods are gone (freed at once: a pod's directory goes after
        its containers have ended)."""
        with self.locked() as allocations:
            for booking_id in released:
                entry = allocations.get(booking_id)
                if entry is not None and is_plugin(entry):
                    del allocations[booking_id]
                    self.event("released", container=booking_id, devices=list(entry.devices))
            for booking_id, known in pods.items():
                entry = allocations.get(booking_id)
                if entry is not None and is_plugin(entry) and tuple(sorted(set(known))) != entry.pods:
                    allocations[booking_id] = entry._replace(pods=tuple(sorted(set(known))))

    def read(self) -> dict[str, LedgerEntry] | None:
        """The ledger's bookings as they are now, without the lock or any housekeeping (its file is replaced
        whole, so a read sees one version): for offers that follow it every second. None when it is missing or
        broken: no word on what is held (the next booking rebuilds it, and the agents book theirs again)."""
        try:
            with open(self.path, "rb") as handle:
                data = jsonlite.loads(handle.read().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return LedgerFile.from_json(data).allocations if ledger_problem(data) is None else None

    def release(self, container_id: str) -> str:
        """poststop: idempotent and quick. The booking ends here; its nodes are free once no container's
        process holds them open, which the next access checks (a booking that wants them, `watch`'s sweep,
        `list`): no scan of /proc, and no process left behind, on the runtime's delete path."""
        if not os.path.exists(self.path):
            return "not allocated"  # nothing was ever booked: touch nothing
        with self.locked() as allocations:
            entry = allocations.get(container_id)
            if entry is None:
                return "not allocated"
            if entry.state == "reclaiming":
                return "already released"  # poststop ran before (or the container was found dead)
            allocations[container_id] = entry._replace(state="reclaiming", released_at=time.time())
            self.event("poststop", container=container_id, devices=list(entry.devices))
            self.reclaim(allocations, wanted=set())
        return "released"

    def sweep(self) -> bool:
        """Free what dead containers held (the node agent, every round): the hook runs no poststop by
        default, and a booking should find the devices it wants already free, not pay for the scan. False
        when the ledger counts another pid namespace's pids (an agent pod without hostPID): the sweep only
        saves the next booking a scan, so it is left to the hooks, which reclaim on every booking."""
        if not os.path.exists(self.path):
            return True  # nothing was ever booked: create nothing
        try:
            with self.locked() as allocations:
                self.reclaim(allocations)
        except ForeignLedgerError:
            return False
        return True

    def entries(self) -> dict[str, LedgerEntry]:
        """Every booking by its id, after the housekeeping `reclaim` does: what `list` and `who` show. None
        booked (and nothing created) where no ledger was ever written."""
        if not os.path.exists(self.path):
            return {}
        with self.locked() as allocations:
            self.reclaim(allocations)
            return dict(allocations)

    def snapshot(self) -> dict[str, object]:
        """The ledger's JSON as its file holds it after `entries`' housekeeping (tests and forensics)."""
        with self.locked() as allocations:
            self.reclaim(allocations)
            return {"allocations": allocations_json(allocations)}


def split_claims(claims: Iterable[tuple[str, Collection[str], Collection[str]]],
                 policy: Mapping[str, str]) -> tuple[set[str], set[str]]:
    """The nodes `claims` (Claims, or a DRA checkpoint's [name, nodes, shared]) hold, (exclusive, shared), as
    their kinds' sharing `policy` says: a shared kind's every node shared; an exclusive claim's own nodes
    exclusive but those it names shared (a MIG parent GPU that others may hold too)."""
    exclusive: set[str] = set()
    shared: set[str] = set()
    for name, nodes, shared_nodes in claims:
        if policy.get(name.partition("=")[0], "exclusive") == "shared":
            shared.update(nodes)
        else:
            shared.update(shared_nodes)
            exclusive.update(n for n in nodes if n not in shared_nodes)
    return exclusive, shared


def checked_consumes(consumes: Consumes) -> Consumes:
    """A copy of a booking's consumable-capacity shares; LedgerError for a share of nothing (it would never
    fill the device) or beyond the device's total."""
    for node, caps in consumes.items():
        for cap, (amount, total) in caps.items():
            if not 0 < amount <= total:
                raise LedgerError(f"device {node}: a {cap} share of {amount} (of {total}) cannot be booked; refused")
    return {n: {k: list(v) for k, v in caps.items()} for n, caps in consumes.items()}
