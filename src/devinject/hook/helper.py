"""The container's edits in a helper process a hook-server worker forks while it waits for a request, so
they overlap the worker's host work (the ledger, the cgroup) and no fork is on the start path.

Given the plan, the helper joins the container's mount namespace and applies it at once; it holds the
edits until the worker, having booked and granted meanwhile, says commit (they stay) or roll back (they
are undone). A worker that goes away, or closes the pipe, means roll back. The in-process hook does the
same edits itself after booking (nsenter.in_mount_namespace): there, a fork costs more than it saves."""

from __future__ import annotations

import os
import select
import time

from devinject.core import jsonlite
from devinject.core.deadline import TooLarge, read_to_eof
from devinject.core.errors import DevinjectError, HookError
from devinject.hook import syscalls

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from devinject.hook.plan import Plan

TIMEOUT = 30.0
MAX_REPORT_BYTES = 16 << 20
COMMIT, ROLL_BACK = b"c", b"r"  # the verdict, after the order
_HEADER = 8  # the order's length, before it
PR_SET_PDEATHSIG = 1
SIGTERM = 15  # not from `signal`: it imports `enum`


class PreparedHelper:
    """Forked now (while nothing waits for it); `send` gives it the work, `commit`/`rollback` end it."""

    def __init__(self, warm: Callable[[], object] | None = None) -> None:
        order_read, self._order = os.pipe()
        self._report, report_write = os.pipe()
        self.deadline = 0.0
        self.finished = False
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the helper
            os.close(self._order)
            os.close(self._report)
            _helper(order_read, report_write, parent, warm)
        os.close(order_read)
        os.close(report_write)

    def send(self, pid: int, rootfs: str, steps: Plan, *, timeout: float = TIMEOUT) -> None:
        """The work: the helper applies it at once (a helper that died already says why in its report)."""
        self.deadline = time.monotonic() + timeout
        payload = jsonlite.dumps({"pid": pid, "rootfs": rootfs, "plan": steps.container_order()}).encode()
        data = len(payload).to_bytes(_HEADER, "big") + payload
        try:
            while data:  # a large plan fills the pipe until the helper reads it: wait, within the deadline
                _, ready, _ = select.select([], [self._order], [], max(self.deadline - time.monotonic(), 0))
                if not ready:
                    self._kill()
                    raise HookError(f"the container-edits helper took no work in {timeout:g}s")
                data = data[os.write(self._order, data[:4096]):]
        except OSError:
            pass  # the helper is gone: its report says why

    def commit(self) -> list[str]:
        """The edits stay: their log, or HookError when making them failed (then they were undone)."""
        payload = self._finish(COMMIT)
        if not payload.get("ok"):
            raise HookError(payload.get("error") or "the container-edits helper died without a report")
        result: list[str] = payload.get("result") or []
        return result

    def rollback(self) -> None:
        """Undo the edits (best effort; a helper that does not answer in time is killed)."""
        try:
            self._finish(ROLL_BACK)
        except HookError:
            pass

    def discard(self) -> None:
        """Not needed after all: the helper exits (nothing was sent) and is reaped."""
        if not self.finished:
            self.rollback()

    def _kill(self) -> None:
        try:
            os.kill(self.pid, syscalls.SIGKILL)
        except ProcessLookupError:
            pass

    def _finish(self, verdict: bytes) -> dict[str, Any]:
        if self.finished:
            return {"ok": False, "error": "already finished"}
        self.finished = True
        if not self.deadline:
            self.deadline = time.monotonic() + TIMEOUT
        try:
            os.write(self._order, verdict)
        except OSError:
            pass  # the helper is gone already (it failed, and said so in its report)
        finally:
            os.close(self._order)
        try:
            report = read_to_eof(self._report, max(self.deadline - time.monotonic(), 0), MAX_REPORT_BYTES)
        except (TimeoutError, TooLarge):
            self._kill()
            raise HookError(f"work in the container's mount namespace did not finish in {TIMEOUT:g}s") from None
        finally:
            os.close(self._report)
            os.waitpid(self.pid, 0)
        try:
            payload = jsonlite.loads(report or b"{}")
        except ValueError:
            payload = {}
        return payload if isinstance(payload, dict) else {}


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from `fd`, or fewer at EOF or when the deadline (None: none, the helper is idle) passes."""
    data = b""
    while len(data) < size:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                break
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _helper(order_fd: int, report_fd: int, parent: int,
            warm: Callable[[], object] | None) -> None:  # pragma: no cover - the helper
    status = 1
    payload: dict[str, Any] = {"ok": False, "error": "the container-edits helper got no work"}
    try:
        syscalls.libc().prctl(PR_SET_PDEATHSIG, SIGTERM)  # never outlive the worker
        if os.getppid() != parent:
            os._exit(0)
        if warm is not None:
            warm()
        header = _read_exact(order_fd, _HEADER, None)  # idle until the worker has a request
        if len(header) < _HEADER:
            os._exit(0)  # not needed (or the worker gone): nothing was done
        deadline = time.monotonic() + TIMEOUT
        order = jsonlite.loads(_read_exact(order_fd, int.from_bytes(header, "big"), deadline))
        from devinject.hook.executor import Executor
        from devinject.hook.plan import Plan

        pid = int(order["pid"])
        try:
            ns_fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise HookError(f"container process {pid}: cannot open its mount namespace: {err.strerror}") from None
        syscalls.setns(ns_fd, syscalls.CLONE_NEWNS)
        os.close(ns_fd)
        os.chdir("/")
        executor = Executor(order["rootfs"])  # in the namespace: what it opens is the container's view
        result = executor.apply(Plan.from_container_order(order["plan"]), hold=True)
        if _read_exact(order_fd, 1, deadline) == COMMIT:
            executor.close()
            payload, status = {"ok": True, "result": result}, 0
        else:  # roll back, the worker gone (EOF) or out of time
            executor.rollback()
            payload = {"ok": False, "error": "rolled back"}
    except DevinjectError as err:
        payload = {"ok": False, "error": err.message}
    except BaseException as err:  # report, never raise across fork
        payload = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        os.write(report_fd, jsonlite.dumps(payload).encode())
    finally:
        os._exit(status)
