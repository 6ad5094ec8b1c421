"""Run a function inside a container's mount namespace: setns from a forked, single-threaded child
(setns(CLONE_NEWNS) fails in a multi-threaded process), result or error back over a pipe, bounded time."""

from __future__ import annotations

import os

from devinject.core import jsonlite
from devinject.core.deadline import TooLarge, read_to_eof
from devinject.core.errors import DevinjectError, HookError
from devinject.hook import syscalls

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

CHILD_TIMEOUT = 30.0
MAX_REPORT_BYTES = 16 << 20


_NAMESPACES = {"mnt": ("mount", syscalls.CLONE_NEWNS), "net": ("network", syscalls.CLONE_NEWNET)}


def run_in_mount_ns(pid: int, fn: Callable[[], Any], *, timeout: float = CHILD_TIMEOUT) -> Any:
    return run_in_namespace(pid, "mnt", fn, timeout=timeout)


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
