"""Work inside a container's namespace from a forked, single-threaded child (setns(CLONE_NEWNS) fails in a
multi-threaded process), result or error back over a pipe, within one deadline.

`NamespaceChild` overlaps the container's edits with the host's work on each container start: forked as
soon as the container is known, the child imports what it needs and joins the namespace while the parent
resolves and plans; it applies the plan it is then sent while the parent books and grants, and holds the
change until the parent says commit (it stays) or roll back (it is undone). A parent that dies or closes
the pipe means roll back."""

from __future__ import annotations

import os
import select
import time

from devinject.core import jsonlite
from devinject.core.deadline import TooLarge, read_to_eof
from devinject.core.errors import DevinjectError, HookError
from devinject.hook import syscalls

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol

    class Change(Protocol):
        """What the child makes in the namespace: apply() makes it (undoing itself when it fails),
        keep() settles it, undo() takes it back."""

        def apply(self) -> Any: ...
        def keep(self) -> None: ...
        def undo(self) -> None: ...

CHILD_TIMEOUT = 30.0
MAX_REPORT_BYTES = 16 << 20
COMMIT, ROLL_BACK = b"c", b"r"  # the verdict after the order
_HEADER = 8  # the order's length, before it

_NAMESPACES = {"mnt": ("mount", syscalls.CLONE_NEWNS), "net": ("network", syscalls.CLONE_NEWNET)}


class _Once:
    """A change with nothing to hold: `fn()` is the whole of it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def apply(self) -> Any:
        return self.fn()

    def keep(self) -> None:
        pass

    def undo(self) -> None:
        pass


def run_in_namespace(pid: int, kind: str, fn: Callable[[], Any], *, timeout: float = CHILD_TIMEOUT) -> Any:
    """`fn()` in a forked child that joined process `pid`'s namespace `kind` ("mnt" or "net")."""
    child = NamespaceChild(pid, kind, lambda _: _Once(fn), timeout=timeout)
    child.send(None)
    return child.commit()


class NamespaceChild:
    """A forked child that runs `preload()` (imports: they run while the parent works) and joins process
    `pid`'s namespace `kind`; there it makes the change with `make(order)` once `send(order)` gives the
    order (JSON data) and applies it, then waits for `commit()` or `rollback()`."""

    def __init__(self, pid: int, kind: str, make: Callable[[Any], Change], *,
                 preload: Callable[[], object] | None = None, timeout: float = CHILD_TIMEOUT) -> None:
        self.words, nstype = _NAMESPACES[kind]
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        try:
            ns_fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise HookError(f"container process {pid}: cannot open its {self.words} namespace: "
                            f"{err.strerror}") from None
        verdict_read, self._verdict = os.pipe()
        self._report, report_write = os.pipe()
        self.finished = False
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the forked child
            os.close(self._verdict)
            os.close(self._report)
            _child(ns_fd, nstype, preload, make, verdict_read, report_write, self.deadline)
        os.close(ns_fd)
        os.close(verdict_read)
        os.close(report_write)

    def send(self, order: object) -> None:
        """The work order: the child applies it at once (a child that died already says why in its report)."""
        payload = jsonlite.dumps(order).encode()
        data = len(payload).to_bytes(_HEADER, "big") + payload
        try:
            while data:  # a large order fills the pipe until the child reads it: wait, within the deadline
                _, ready, _ = select.select([], [self._verdict], [], max(self.deadline - time.monotonic(), 0))
                if not ready:
                    os.kill(self.pid, syscalls.SIGKILL)
                    raise HookError(f"the container's {self.words} namespace child took no order in "
                                    f"{self.timeout:g}s")
                data = data[os.write(self._verdict, data[:65536]):]
        except OSError:
            pass  # the child is gone: its report says why

    def commit(self) -> Any:
        """The change stays: its result, or HookError when applying it failed (then it is undone)."""
        payload = self._finish(COMMIT)
        if not payload.get("ok"):
            raise HookError(payload.get("error") or f"the {self.words} namespace child died without a report")
        return payload.get("result")

    def rollback(self) -> None:
        """Undo the change (best effort; a child that does not answer in time is killed)."""
        try:
            self._finish(ROLL_BACK)
        except HookError:
            pass

    def _finish(self, verdict: bytes) -> dict[str, Any]:
        if self.finished:
            return {"ok": False, "error": "already finished"}
        self.finished = True
        try:
            os.write(self._verdict, verdict)
        except OSError:
            pass  # the child is gone already (it failed, and said so in its report)
        finally:
            os.close(self._verdict)
        try:
            report = read_to_eof(self._report, max(self.deadline - time.monotonic(), 0), MAX_REPORT_BYTES)
        except (TimeoutError, TooLarge):
            os.kill(self.pid, syscalls.SIGKILL)
            raise HookError(f"work in the container's {self.words} namespace did not finish in "
                            f"{self.timeout:g}s") from None
        finally:
            os.close(self._report)
            os.waitpid(self.pid, 0)
        try:
            payload = jsonlite.loads(report or b"{}")
        except ValueError:
            payload = {}
        return payload if isinstance(payload, dict) else {}


def _read_exact(fd: int, size: int, deadline: float) -> bytes:
    """`size` bytes from `fd`, or fewer when it reaches EOF or time is up first."""
    data = b""
    while len(data) < size:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(fd, size - len(data)) if ready else b""
        if not chunk:
            break
        data += chunk
    return data


def _child(ns_fd: int, nstype: int, preload: Callable[[], object] | None, make: Callable[[Any], Change],
           verdict_fd: int, report_fd: int, deadline: float) -> None:  # pragma: no cover - the forked child
    status = 1
    try:
        if preload is not None:
            preload()
        syscalls.setns(ns_fd, nstype)
        os.chdir("/")
        header = _read_exact(verdict_fd, _HEADER, deadline)
        if len(header) < _HEADER:  # rolled back (or the parent gone) before any order: nothing to undo
            os._exit(1)
        order = _read_exact(verdict_fd, int.from_bytes(header, "big"), deadline)
        change = make(jsonlite.loads(order))  # in the namespace: what it opens is the container's view
        result = change.apply()
        verdict = _read_exact(verdict_fd, 1, deadline)
        if verdict == COMMIT:
            change.keep()
            payload = {"ok": True, "result": result}
            status = 0
        else:  # roll back, the parent gone (EOF) or out of time
            change.undo()
            payload = {"ok": False, "error": "rolled back"}
    except DevinjectError as err:
        payload = {"ok": False, "error": err.message}
    except BaseException as err:  # report, never raise across fork
        payload = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        os.write(report_fd, jsonlite.dumps(payload).encode())
    finally:
        os._exit(status)
