"""The DRA drivers' checkpoints as the ledger reads them when it is rebuilt: a claim prepared on the node holds
its devices whether or not any container runs yet, and live evidence cannot show that. One file per driver,
`<state dir>/dra-<driver>.checkpoint.json` (dra/claims.py writes it, 0600, fsynced); each claim's `ledger`
entries are its bookings ([name, nodes, shared]), `pods` the pods it is reserved for and `consumes` its
consumable-capacity shares (node -> capacity -> [amount, total]).
"""

from __future__ import annotations

import os
import stat

from devinject.core import jsonlite

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PREFIX, SUFFIX = "dra-", ".checkpoint.json"
CHECKPOINT_VERSION = 1
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


def _load(path: str) -> dict[str, Any] | None:
    """A checkpoint's claims: a regular file of this user's nobody else can write; None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        data = jsonlite.loads(os.read(fd, MAX_CHECKPOINT).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("version") != CHECKPOINT_VERSION \
            or not isinstance(data.get("claims"), dict):
        return None
    return data["claims"]  # type: ignore[no-any-return]


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
        claims = _load(os.path.join(state_dir, filename))
        if claims is None:
            unreadable.append(filename)
            continue
        for uid, entry in claims.items():
            if not isinstance(entry, dict):
                continue
            booked = [(b[0], b[1], b[2]) for b in entry.get("ledger", [])
                      if isinstance(b, list) and len(b) == 3 and isinstance(b[0], str) and _strings(b[1])
                      and _strings(b[2])]
            if booked:
                bookings[booking_id(driver, str(uid))] = booked
                pods[booking_id(driver, str(uid))] = [p for p in entry.get("pods", []) if isinstance(p, str)]
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
        claims = _load(os.path.join(state_dir, filename)) or {}
        for uid, entry in claims.items():
            consumes = entry.get("consumes") if isinstance(entry, dict) else None
            if consumes and not consumes_problem(consumes):
                out[booking_id(filename[len(PREFIX):-len(SUFFIX)], str(uid))] = consumes
    return out
