"""The health loop's memory across restarts: published verdicts and the readings they rest on.

`<state-dir>/health-state.json` (root's, mode 0600, replaced atomically) holds what a new `watch` or
`device-plugin` process must not learn afresh from the hardware:

* per device: what the specs and the kubelet show (`published`), the last verdict (status, reasons, nodes)
  and the identity of each of its PCI functions (`function_identity`: the boot and the sysfs inode);
* per PCI function: the AER totals taken as its baseline (an increase over it is a failure);
* the kernel log's identity and the offset read up to, and the error codes read from it per slot.

A fatal verdict (AER fatal errors increasing, a fatal Xid) is sticky: the readings it rests on stay until
one of two things clears them — the device is enumerated again (a function identity changes: removal and
re-add, a PCI rescan, a reboot), or an admin asks with `devinject put-back DEVICE`, which accepts the AER
totals it reads at that moment and drops the kernel-log errors read so far. Either way the device then goes
back only after `--threshold` passing checks, with a `put-back` event.

A file that cannot be read, does not validate, or is not root's alone (another owner, group/other
writable, a link) is never trusted: it is moved aside, and the agent starts as if every device had been
taken out, with AER baselines of zero and the whole kernel log read (what `devinject health` judges by).
A device goes back only when it passes on that evidence; a failing GPU is never put back by a broken file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from devinject.agent.health import PutBack
from devinject.core import atomicfile, jsonlite
from devinject.core.errors import DevinjectError
from devinject.linux import filelock
from devinject.linux.trusteddir import make_dirs
from devinject.nodestate import healthverdicts
from devinject.nodestate.healthverdicts import DeviceVerdict
from devinject.nodestate.statefile import StateFileError, UnreadableStateFile

if TYPE_CHECKING:
    from devinject.discovery.node import Node

log = logging.getLogger(__name__)

STATE_FILE = "health-state.json"
LOOP_LOCK = ".health-loop.lock"  # held by the one health loop of a state dir while it runs
LOOP_WANTED = ".health-loop.wanted"  # touched by an agent waiting for the lock: a stand-in loop hands it over
LOOP_WANTED_FRESH = 5.0  # seconds a request stays valid without being touched again (a waiter that died)
REQUESTS_FILE = "put-back-requests.json"
PUT_BACKS_FILE = "put-backs.json"  # the last put-back per device, kept: what a reader without an agent honours
REQUESTS_LOCK = ".put-back.lock"
VERSION = 1
MAX_BYTES = 8 << 20
_STATUSES = ("healthy", "degraded", "unhealthy")


class Untrusted(ValueError):
    """A state file that must not be believed (unreadable, invalid, or not root's alone)."""


@dataclass
class TrackedDevice:
    kind: str
    address: str
    published: str
    observed: str
    reasons: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    functions: dict[str, str] = field(default_factory=dict)  # PCI address -> identity


@dataclass
class HealthState:
    devices: dict[str, TrackedDevice] = field(default_factory=dict)
    aer: dict[str, tuple[int, int]] = field(default_factory=dict)
    log_identity: str | None = None
    log_offset: int | None = None
    log_errors: dict[str, list[int]] = field(default_factory=dict)


def read_owned(path: str) -> bytes | None:
    """A state file's bytes, or None when there is none; Untrusted when it is there but not root's alone (the
    caller's owner, not group/other writable, a regular file reached without a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise Untrusted(f"{path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise Untrusted(f"{path}: owned by uid {st.st_uid}, not {os.geteuid()}")
        if st.st_mode & 0o022:
            raise Untrusted(f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BYTES:
                raise Untrusted(f"{path}: larger than {MAX_BYTES} bytes")
        return b"".join(chunks)
    except OSError as err:
        raise Untrusted(f"{path}: {err.strerror}") from None
    finally:
        os.close(fd)


def _need(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise Untrusted(f"{where}: expected {getattr(kind, '__name__', 'a value')}")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_need(item, str, f"{where}[{i}]") for i, item in enumerate(_need(value, list, where)))


def _counts(value: Any, where: str) -> tuple[int, int]:
    pair = _need(value, list, where)
    if len(pair) != 2 or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in pair):
        raise Untrusted(f"{where}: expected [fatal, non-fatal] counts")
    return pair[0], pair[1]


def _status(value: Any, where: str) -> str:
    if value not in _STATUSES:
        raise Untrusted(f"{where}: expected one of {', '.join(_STATUSES)}")
    return str(value)


def parse_state(data: bytes, where: str = STATE_FILE) -> HealthState:
    """The state from the file's bytes; Untrusted (naming the field) when any part does not validate: one
    bad entry discredits the file, since the entry may be the verdict that keeps a GPU out."""
    try:
        raw = jsonlite.loads(data)
    except ValueError as err:
        raise Untrusted(f"{where}: not JSON ({err})") from None
    _need(raw, dict, where)
    if raw.get("version") != VERSION:
        raise Untrusted(f"{where}.version: expected {VERSION}")
    state = HealthState()
    for key, entry in _need(raw.get("devices"), dict, f"{where}.devices").items():
        at = f"{where}.devices[{key!r}]"
        _need(entry, dict, at)
        functions = _need(entry.get("functions"), dict, f"{at}.functions")
        state.devices[key] = TrackedDevice(
            kind=_need(entry.get("kind"), str, f"{at}.kind"), address=_need(entry.get("address"), str, f"{at}.address"),
            published=_status(entry.get("published"), f"{at}.published"),
            observed=_status(entry.get("observed"), f"{at}.observed"),
            reasons=_strings(entry.get("reasons"), f"{at}.reasons"), nodes=_strings(entry.get("nodes"), f"{at}.nodes"),
            functions={fn: _need(ident, str, f"{at}.functions[{fn!r}]") for fn, ident in functions.items()})
    for address, pair in _need(raw.get("aer"), dict, f"{where}.aer").items():
        state.aer[address] = _counts(pair, f"{where}.aer[{address!r}]")
    kernel_log = _need(raw.get("kernel_log"), dict, f"{where}.kernel_log")
    identity, offset = kernel_log.get("identity"), kernel_log.get("offset")
    if identity is not None:
        _need(identity, str, f"{where}.kernel_log.identity")
    if offset is not None and (_need(offset, int, f"{where}.kernel_log.offset") < 0):
        raise Untrusted(f"{where}.kernel_log.offset: negative")
    state.log_identity, state.log_offset = identity, offset
    for slot, codes in _need(kernel_log.get("errors"), dict, f"{where}.kernel_log.errors").items():
        items = _need(codes, list, f"{where}.kernel_log.errors[{slot!r}]")
        state.log_errors[slot] = [_need(c, int, f"{where}.kernel_log.errors[{slot!r}]") for c in items]
    return state


def encode_state(state: HealthState) -> bytes:
    devices = {key: {"kind": r.kind, "address": r.address, "published": r.published, "observed": r.observed,
                     "reasons": list(r.reasons), "nodes": list(r.nodes), "functions": dict(r.functions)}
               for key, r in state.devices.items()}
    return jsonlite.dumps({
        "version": VERSION, "devices": devices, "aer": {a: list(c) for a, c in state.aer.items()},
        "kernel_log": {"identity": state.log_identity, "offset": state.log_offset, "errors": state.log_errors},
    }, sort_keys=True).encode()


def load_state(state_dir: str) -> HealthState | None:
    """The persisted state; None when there is none (a first start, or /run after a reboot). Untrusted when
    it is there but must not be believed."""
    path = os.path.join(state_dir, STATE_FILE)
    data = read_owned(path)
    return None if data is None else parse_state(data, path)


def save_state(state_dir: str, data: bytes) -> None:
    """Replace the state file with `data` (mode 0600, fsynced: a verdict survives a crash). OSError is the
    caller's."""
    make_dirs(state_dir)  # 0755 whatever the umask (the agent checked it at its start: linux/trusteddir)
    atomicfile.replace(os.path.join(state_dir, STATE_FILE), data, 0o600, sync=True)


def take_loop_lock(state_dir: str) -> int | None:
    """Claim the state dir for one health loop (`watch`, `device-plugin` or `dra-driver`): an open fd holding an
    exclusive flock on `<state-dir>/.health-loop.lock` for as long as the process keeps it, or None when
    another process's loop holds it (two loops would both rewrite health-state.json and take each other's
    put-back requests). The kernel drops the lock when its holder dies: no stale lock outlives a crash."""
    import fcntl

    make_dirs(state_dir)
    fd = os.open(os.path.join(state_dir, LOOP_LOCK), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def ask_for_loop(state_dir: str) -> None:
    """Say that this agent (`watch`, `device-plugin`) waits for the state dir's health loop: a `dra-driver
    --health auto` that took the loop over while the agent was down hands it back (touched again while the
    agent waits; a request older than LOOP_WANTED_FRESH counts for nothing, so a waiter that died asks
    nothing). Its mtime is the whole message: no pid, which another pid namespace could not read."""
    path = os.path.join(state_dir, LOOP_WANTED)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


def loop_wanted(state_dir: str) -> bool:
    """An agent asked for the state dir's health loop within LOOP_WANTED_FRESH seconds."""
    try:
        st = os.lstat(os.path.join(state_dir, LOOP_WANTED))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and abs(time.time() - st.st_mtime) < LOOP_WANTED_FRESH


def withdraw_loop_request(state_dir: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(state_dir, LOOP_WANTED))


def move_aside(state_dir: str, name: str = STATE_FILE) -> str | None:
    """Keep a distrusted file for the admin as `<name>.broken-<ns>`; the new name, or None if it could not move."""
    path = os.path.join(state_dir, name)
    target = f"{path}.broken-{time.time_ns()}"
    try:
        os.rename(path, target)
    except OSError:
        return None
    return target


# --- put-back requests: the admin's side writes them, the agent takes them ----------------------------------
def _requests_lock(state_dir: str, timeout: float) -> filelock.exclusive:
    return filelock.exclusive(os.path.join(state_dir, REQUESTS_LOCK), timeout=timeout, what="put-back request")


def _read_requests(state_dir: str) -> dict[str, dict[str, Any]]:
    path = os.path.join(state_dir, REQUESTS_FILE)
    data = read_owned(path)
    if data is None:
        return {}
    try:
        raw = jsonlite.loads(data)
    except ValueError as err:
        raise Untrusted(f"{path}: not JSON ({err})") from None
    requests: dict[str, dict[str, Any]] = {}
    for key, entry in _need(raw, dict, path).items():
        at = f"{path}[{key!r}]"
        aer = _need(_need(entry, dict, at).get("aer"), dict, f"{at}.aer")
        requests[key] = {"time": _need(entry.get("time"), (int, float), f"{at}.time"),
                         "aer": {fn: _counts(pair, f"{at}.aer[{fn!r}]") for fn, pair in aer.items()}}
    return requests


def add_request(state_dir: str, key: str, aer: dict[str, tuple[int, int]]) -> None:
    """Ask the agent to clear `key`'s sticky verdicts, accepting these AER totals as its new baseline. A
    broken requests file is replaced: what it asked for is asked again by whoever asked."""
    with _requests_lock(state_dir, 10.0):
        try:
            requests = _read_requests(state_dir)
        except Untrusted as err:
            log.warning("%s; replacing it", err)
            move_aside(state_dir, REQUESTS_FILE)
            requests = {}
        requests[key] = {"time": round(time.time(), 3), "aer": {fn: list(c) for fn, c in aer.items()}}
        atomicfile.replace(os.path.join(state_dir, REQUESTS_FILE), jsonlite.dumps(requests, sort_keys=True).encode(),
                           0o600, sync=True)


def take_requests(state_dir: str) -> dict[str, dict[str, tuple[int, int]]]:
    """The pending put-back requests (device key -> the AER totals accepted per function), removed from the
    file. A requests file that is not to be trusted asks for nothing: it is moved aside and logged, and every
    device stays as it is."""
    if not os.path.exists(os.path.join(state_dir, REQUESTS_FILE)):
        return {}
    try:
        with _requests_lock(state_dir, 1.0):
            try:
                requests = _read_requests(state_dir)
            except Untrusted as err:
                log.error("put-back requests ignored: %s (moved to %s)", err, move_aside(state_dir, REQUESTS_FILE))
                return {}
            if requests:
                os.unlink(os.path.join(state_dir, REQUESTS_FILE))
    except (DevinjectError, OSError) as err:  # busy: the next round takes them
        log.warning("put-back requests: %s", getattr(err, "message", err))
        return {}
    return {key: entry["aer"] for key, entry in requests.items()}


def _load_readable(path: str) -> Any:
    """A state file any user may read (put-backs.json, health.json: no owner check, unlike read_owned),
    parsed whole up to MAX_BYTES. OSError as raised (FileNotFoundError when there is none); Untrusted when it
    is larger or not JSON."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise Untrusted(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        return jsonlite.loads(data)
    except ValueError as err:
        raise Untrusted(f"{path}: not JSON ({err})") from None


def _read_put_backs(state_dir: str) -> dict[str, PutBack]:
    path = os.path.join(state_dir, PUT_BACKS_FILE)
    try:
        raw = _load_readable(path)
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise Untrusted(f"{path}: {err.strerror}") from None
    out: dict[str, PutBack] = {}
    for key, entry in _need(raw, dict, path).items():
        at = f"{path}[{key!r}]"
        aer = _need(_need(entry, dict, at).get("aer"), dict, f"{at}.aer")
        position = _need(entry.get("kernel_log"), dict, f"{at}.kernel_log")
        identity, offset = position.get("identity"), position.get("offset")
        if identity is not None:
            _need(identity, str, f"{at}.kernel_log.identity")
        if offset is not None and _need(offset, int, f"{at}.kernel_log.offset") < 0:
            raise Untrusted(f"{at}.kernel_log.offset: negative")
        out[key] = PutBack(float(_need(entry.get("time"), (int, float), f"{at}.time")),
                           {fn: _counts(pair, f"{at}.aer[{fn!r}]") for fn, pair in aer.items()}, identity, offset)
    return out


def load_put_backs(state_dir: str | None) -> dict[str, PutBack]:
    """The put-backs recorded in the state dir (none without one); DevinjectError naming the file when it
    cannot be read or does not validate (a reader must not guess which errors an admin cleared)."""
    if not state_dir:
        return {}
    try:
        return _read_put_backs(state_dir)
    except Untrusted as err:
        raise DevinjectError(f"{err} (a devinject put-back record; remove it to judge from the whole kernel "
                             "log again)") from None


def _record_put_back(state_dir: str, key: str, aer: dict[str, tuple[int, int]],
                     position: tuple[str | None, int | None]) -> None:
    """Keep `key`'s put-back for the readers (world-readable, as health.json: it says nothing secret). A
    broken file is replaced: the readers said so until now, and this put-back is the newest word."""
    with _requests_lock(state_dir, 10.0):
        try:
            kept = _read_put_backs(state_dir)
        except Untrusted as err:
            log.warning("%s; replacing it", err)
            kept = {}
        records = {k: {"time": p.time, "aer": {fn: list(c) for fn, c in p.aer.items()},
                       "kernel_log": {"identity": p.log_identity, "offset": p.log_offset}} for k, p in kept.items()}
        records[key] = {"time": round(time.time(), 3), "aer": {fn: list(c) for fn, c in aer.items()},
                        "kernel_log": {"identity": position[0], "offset": position[1]}}
        atomicfile.replace(os.path.join(state_dir, PUT_BACKS_FILE), jsonlite.dumps(records, sort_keys=True).encode(),
                           0o644, sync=True)


# --- the verdicts the agents act on, as the readers show them -------------------------------------------------
Published = DeviceVerdict  # one device as the agent published it (nodestate/healthverdicts.py owns health.json)


def load_published(state_dir: str | None) -> dict[str, DeviceVerdict] | None:
    """The agent's published verdicts per device key (health.json, the file the ledger and the DRA driver
    read); None when no agent wrote one. DevinjectError naming the file when it cannot be read or is not a
    devinject health file: the ledger refuses every booking on such a file, so no reader may call it healthy."""
    if not state_dir:
        return None
    try:
        verdicts = healthverdicts.read(state_dir)
    except UnreadableStateFile as err:
        raise DevinjectError(err.message) from None
    except StateFileError as err:
        raise DevinjectError(f"{err} (not a devinject health file: the ledger books nothing while it is there; "
                             "the agent writes it again at its next change, or remove it)") from None
    return None if verdicts is None else verdicts.devices


def request_put_back(root: str, state_dir: str, device: str, profile_dirs: tuple[str, ...] = (), *,
                     node: Node | None = None, kernel_log: str | None = None) -> tuple[str, dict[str, tuple[int, int]]]:
    """`devinject put-back DEVICE`: the admin clears DEVICE's sticky verdicts (its key, a PCI address of one of
    its functions, or a CDI name). Its AER totals as they read now become its baseline; the agent takes the
    request at its next round (or when it starts) and puts the device back once `--threshold` checks pass.
    `node`: the node the command made (else the one at `root` with `profile_dirs`)."""
    from devinject.agent.health import aer_totals
    from devinject.agent.kernelmsg import current_position
    from devinject.cdi.identity import device_key
    from devinject.discovery.node import Node
    from devinject.nodestate import events

    node = node or Node(root, profile_dirs=profile_dirs, check=False)
    host = node.host
    from devinject.discovery.resolve import resolve_one

    named = resolve_one(node, device)
    if named.channels:  # no readings to accept: its node is there again or not
        key, accepted = named.channels[0].key, {}
    else:
        (found,) = named.devices
        key = device_key(found.profile.kind, found.address)
        accepted = {pci.address: aer_totals(host, pci) for pci in found.functions}
    try:
        add_request(state_dir, key, accepted)
        _record_put_back(state_dir, key, accepted, current_position(host, kernel_log or node.kernel_log))
        events.record(state_dir, "put-back-requested", key, aer={fn: list(c) for fn, c in accepted.items()},
                      uid=os.getuid())
    except OSError as err:
        raise DevinjectError(f"{state_dir}: cannot record the put-back request: {err.strerror}") from None
    return key, accepted
