"""Run a function inside a container's namespace, within a deadline.

`in_mount_namespace` (the container's edits, on every container start) joins the namespace in this very
process and returns to the host's afterwards: the hook is single-threaded (setns(CLONE_NEWNS) fails in a
multi-threaded process), and a fork costs more here than all the edits (~1 ms, plus copy-on-write faults
while the child works). `run_in_namespace` forks a child for work that may start threads (netlink)."""

from __future__ import annotations

import os

from devinject.core import jsonlite
from devinject.core.deadline import TooLarge, read_to_eof
from devinject.core.errors import DevinjectError, HookError
from devinject.linux import syscalls

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
    from typing import Any
else:
    import _signal  # what `signal` wraps: `signal` imports `enum`, a millisecond on every container start

CHILD_TIMEOUT = 30.0
MAX_REPORT_BYTES = 16 << 20


_NAMESPACES = {"mnt": ("mount", syscalls.CLONE_NEWNS), "net": ("network", syscalls.CLONE_NEWNET)}


def in_mount_namespace(pid: int, fn: Callable[[], Any], *, timeout: float = CHILD_TIMEOUT) -> Any:
    """`fn()` in process `pid`'s mount namespace, then back in this process's own. Out of time, `fn` is
    interrupted with HookError (its own rollback runs) by SIGALRM; not coming back is fatal."""
    fds: list[int] = []
    try:
        fds.append(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
        fds.append(os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))  # the way back
        fds.append(os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as err:
        for fd in fds:
            os.close(fd)
        what = "the container process's" if not fds else "this process's own"
        raise HookError(f"container process {pid}: cannot open {what} mount namespace or directory: "
                        f"{err.strerror}") from None
    target, home, cwd = fds

    def out_of_time(signum: int, frame: object) -> None:
        raise HookError(f"work in the container's mount namespace did not finish in {timeout:g}s")

    previous = _signal.signal(_signal.SIGALRM, out_of_time)
    _signal.setitimer(_signal.ITIMER_REAL, timeout)
    try:
        try:
            syscalls.setns(target, syscalls.CLONE_NEWNS)
        except OSError as err:
            raise HookError(f"container process {pid}: cannot join its mount namespace: "
                            f"{os.strerror(err.errno or 0)}") from None
        try:
            os.chdir("/")
            return fn()
        finally:
            _signal.setitimer(_signal.ITIMER_REAL, 0)  # no alarm on the way back
            try:
                syscalls.setns(home, syscalls.CLONE_NEWNS)
                os.fchdir(cwd)
            except OSError as err:  # still in the container's namespace: nothing more may run here
                os.write(2, f"devinject: error: cannot return to the host's mount namespace: {err}\n".encode())
                os._exit(3)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _signal.signal(_signal.SIGALRM, previous)
        for fd in fds:
            os.close(fd)


def run_in_namespace(pid: int, kind: str, fn: Callable[[], Any], *, timeout: float = CHILD_TIMEOUT) -> Any:
    """`fn()` in a forked child that joined process `pid`'s namespace `kind` ("mnt" or "net")."""
    words, nstype = _NAMESPACES[kind]
    try:
        ns_fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise HookError(f"container process {pid}: cannot open its {words} namespace: {err.strerror}") from None
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        os.close(read_end)
        status = 1
        try:
            syscalls.setns(ns_fd, nstype)
            os.chdir("/")
            payload = {"ok": True, "result": fn()}
            status = 0
        except DevinjectError as err:
            payload = {"ok": False, "error": err.message}
        except BaseException as err:  # report, never raise across fork
            payload = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        try:
            os.write(write_end, jsonlite.dumps(payload).encode())
        finally:
            os._exit(status)
    os.close(ns_fd)
    os.close(write_end)
    try:
        report = read_to_eof(read_end, timeout, MAX_REPORT_BYTES)
    except (TimeoutError, TooLarge):
        os.kill(child, syscalls.SIGKILL)
        raise HookError(f"work in the container's {words} namespace did not finish in {timeout:g}s") from None
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    try:
        payload = jsonlite.loads(report or b"{}")
    except ValueError:
        payload = {}
    if not payload.get("ok"):
        raise HookError(payload.get("error") or "the namespace child died without a report")
    return payload.get("result")
