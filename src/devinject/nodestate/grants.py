"""What the node's own agents handed a pod's container, as the hook checks it: a pod user writes annotations
and env, never these.

A container of a Kubernetes pod (its cgroup names the pod: nodestate/podcgroup.py) gets from the hook only
1. what the device plugin granted it at `Allocate`: a grant record `<state dir>/grants/<token>.json`
   (`{"resource", "names", "time"}`, root's, 0600 in a 0700 directory) whose token, 128 random bits, the
   plugin hands the container in its env (`DEVINJECT_GRANT_<RESOURCE>=<token>`, set by the kubelet). The
   first pod whose container presents a token binds it (`<token>.pod`, created O_EXCL): a restarted container
   of that pod presents it again and is served, any other pod is refused. A token cannot be guessed, and a
   pod that read its own is bound to it;
2. the devices of a DRA claim the driver booked in the ledger for that pod (`pods`).
Any other name (a `cdi.k8s.io/*` pod annotation the runtime passed through, an env variable) does not count.
Lean: the hook imports this.
"""

from __future__ import annotations

import os
import stat
import time

from devinject.core import jsonlite
from devinject.core.errors import DevinjectError

GRANTS_DIR = "grants"
GRANT_ENV_PREFIX = "DEVINJECT_GRANT_"
TOKEN_HEX = 32
MAX_GRANT_BYTES = 64 * 1024
STALE_UNBOUND = 24 * 3600.0  # an Allocate whose container never started
STALE_BOUND = 24 * 3600.0  # a binding this old, its pod in no booking of the ledger: the pod is gone
_HEX = frozenset("0123456789abcdef")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class GrantError(DevinjectError):
    """A grant the plugin cannot write."""


def grant_env_key(resource: str) -> str:
    """`DEVINJECT_GRANT_NVIDIA_COM_GPU`: one variable per resource (the kubelet merges several plugins' env)."""
    return GRANT_ENV_PREFIX + "".join(c if c.isalnum() else "_" for c in resource).upper()


def valid_token(token: str) -> bool:
    return len(token) == TOKEN_HEX and set(token) <= _HEX


def grants_dir(state_dir: str) -> str:
    return os.path.join(state_dir, GRANTS_DIR)


def _checked_dir(path: str, *, create: bool) -> bool:
    """The grants directory: made 0700 (whatever the umask), or checked root's (this user's) alone."""
    from devinject.linux.trusteddir import trusted_dir

    if not create and not os.path.lexists(path):
        return False
    trusted_dir(path, 0o700, what="grants directory", error=GrantError)
    return True


def write_grant(state_dir: str, resource: str, names: tuple[str, ...], *, now: float | None = None) -> str:
    """Record that the plugin gave `names` of `resource` to one container; the token for its env."""
    import secrets

    from devinject.core.atomicfile import replace
    from devinject.linux.trusteddir import trusted_dir

    trusted_dir(state_dir, error=GrantError)
    directory = grants_dir(state_dir)
    _checked_dir(directory, create=True)
    token = secrets.token_hex(TOKEN_HEX // 2)
    record = {"resource": resource, "names": list(names), "time": time.time() if now is None else now}
    try:
        replace(os.path.join(directory, f"{token}.json"), jsonlite.dumps(record, sort_keys=True).encode(), 0o600)
    except OSError as err:
        raise GrantError(f"{directory}: cannot write a grant: {err.strerror}") from None
    return token


def _read_owned(path: str) -> bytes | None:
    """A regular file of root's (this user's) that nobody else can write, read without following a link."""
    try:
        fd = os.open(path, _READ)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022
                or st.st_size > MAX_GRANT_BYTES):
            return None
        return os.read(fd, MAX_GRANT_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def _bind(directory: str, token: str, pod: str) -> bool:
    """Bind the token to `pod` (the first pod to present it wins, atomically); whether it is `pod`'s."""
    path = os.path.join(directory, f"{token}.pod")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        held = _read_owned(path)
        return held is not None and held.decode("utf-8", "replace").strip() == pod
    except OSError:
        return False
    try:
        os.write(fd, pod.encode() + b"\n")
    finally:
        os.close(fd)
    return True


def tokens_in(env: tuple[str, ...]) -> list[str]:
    """Every grant token the container's env presents (every definition: the kubelet's is one of them)."""
    return [value for key, sep, value in (entry.partition("=") for entry in env)
            if sep and key.startswith(GRANT_ENV_PREFIX)]


def redeem(state_dir: str, tokens: list[str], pod: str) -> tuple[list[str], list[str]]:
    """(the names the tokens grant `pod`, why any token was refused)."""
    names: list[str] = []
    refused: list[str] = []
    directory = grants_dir(state_dir)
    try:
        present = _checked_dir(directory, create=False)
    except GrantError as err:
        return [], [err.message]
    for token in dict.fromkeys(tokens):
        shown = token[:8] + "..." if len(token) > 8 else token
        if not valid_token(token) or not present:
            refused.append(f"grant {shown}: no such grant")
            continue
        raw = _read_owned(os.path.join(directory, f"{token}.json"))
        try:
            record = jsonlite.loads(raw) if raw is not None else None
        except ValueError:
            record = None
        granted = record.get("names") if isinstance(record, dict) else None
        if not isinstance(granted, list) or not all(isinstance(n, str) for n in granted):
            refused.append(f"grant {shown}: no such grant")
            continue
        if not _bind(directory, token, pod):
            refused.append(f"grant {shown}: bound to another pod")
            continue
        names.extend(granted)
    return names, refused


def claimed_for_pod(state_dir: str, pod: str) -> list[str]:
    """The devices of the DRA claims booked in the ledger for `pod` (a broken ledger: none)."""
    from devinject.nodestate.ledger import read_entries

    return [name for entry in read_entries(state_dir).values() if pod in (entry.pods or ())
            for name in entry.devices]


def prune(state_dir: str, *, now: float | None = None, live_pods: set[str] | None = None) -> int:
    """Remove grants no container will present again: unbound ones older than a day, and bound ones whose
    binding is a day old and whose pod `live_pods` (default: the pods of the ledger's bookings) lacks."""
    directory = grants_dir(state_dir)
    now = time.time() if now is None else now
    if live_pods is None:
        live_pods = _booked_pods(state_dir)
    removed = 0
    try:
        entries = os.listdir(directory)
    except OSError:
        return 0
    for entry in entries:
        token, _, suffix = entry.partition(".")
        if suffix != "json" or not valid_token(token):
            continue
        path = os.path.join(directory, entry)
        binding = os.path.join(directory, f"{token}.pod")
        try:
            bound = os.lstat(binding)
        except FileNotFoundError:
            bound = None
        except OSError:
            continue
        try:
            if bound is None:
                if now - os.lstat(path).st_mtime < STALE_UNBOUND:
                    continue
            else:
                held = (_read_owned(binding) or b"").decode("utf-8", "replace").strip()
                if now - bound.st_mtime < STALE_BOUND or held in live_pods:
                    continue
                os.unlink(binding)
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


def _booked_pods(state_dir: str) -> set[str]:
    from devinject.nodestate.ledger import read_entries

    pods: set[str] = set()
    for entry in read_entries(state_dir).values():
        if entry.pod is not None:
            pods.add(entry.pod)
        pods.update(entry.pods or ())
    return pods
