"""`devinject hook-server`: a resident process the hook hands its invocation to (hook/client.py).

What it saves is what every container start pays before doing any work: the hook's imports and, in the
namespace child, ctypes and the executor. It keeps no state: each request is served by a fresh worker
forked from the server (a single-threaded process, so it may join namespaces), which runs exactly what
the hook runs in-process — the same arguments, the same config file, specs, ledger and log, with the
runtime's own stdin, stdout and stderr passed over the socket — and reports the exit status.

Only a peer running as the server's own user is served (SO_PEERCRED), and the socket is created mode 0600
in a directory only that user can write. A new devinject version takes effect when the server restarts.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import sys
import threading

from devinject.core.errors import DevinjectError
from devinject.hook.client import MAX_REQUEST, decode_request

log = logging.getLogger("devinject.hook-server")

# What a container start loads: imported once here, so no worker imports anything.
PRELOAD = ("devinject.hook.main", "devinject.hook.state", "devinject.hook.request", "devinject.hook.registry",
           "devinject.hook.plan", "devinject.hook.nsenter", "devinject.hook.executor", "devinject.hook.cgroup",
           "devinject.hook.bpf", "devinject.nodestate.ledger", "devinject.nodestate.sharing",
           "devinject.nodestate.evidence")
RECEIVE_TIMEOUT = 5.0


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from devinject.hook import syscalls

    syscalls.libc()  # ctypes and libc, loaded once


def listen(path: str) -> socket.socket:
    """The server socket at `path`: its directory created (0755) when missing and refused when others can
    write it; a stale socket replaced, anything else at `path` refused."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o755, exist_ok=True)
    st = os.stat(directory)
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
    if st.st_uid != os.geteuid() or others_write:
        raise DevinjectError(f"{directory}: the hook server's directory must be owned by this user and not "
                             "writable by others")
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise DevinjectError(f"{path}: exists and is not a socket")
        os.unlink(path)  # a socket a previous server left
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # 0600 from the start: no window where others may connect
    try:
        server.bind(path)
    finally:
        os.umask(old_umask)
    server.listen(128)
    return server


def serve(path: str, stop: threading.Event | None = None, ready: threading.Event | None = None) -> None:
    """Serve hook requests on `path` until `stop` is set (or forever)."""
    preload()
    server = listen(path)
    server.settimeout(0.5)  # wake up to reap workers and to see `stop`
    log.info("hook server on %s", path)
    if ready is not None:
        ready.set()
    try:
        while stop is None or not stop.is_set():
            _reap()
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            try:
                _take(server, conn)
            except OSError as err:
                log.warning("hook request dropped: %s", err)
            finally:
                conn.close()
    finally:
        server.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        _reap()


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _take(server: socket.socket, conn: socket.socket) -> None:
    peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    uid = int.from_bytes(peer[4:8], sys.byteorder)
    if uid != os.geteuid():
        log.warning("hook request from uid %d refused", uid)
        return
    conn.settimeout(RECEIVE_TIMEOUT)
    data, ancillary, _, _ = conn.recvmsg(MAX_REQUEST + 4, socket.CMSG_SPACE(3 * 4))
    fds = [int.from_bytes(cmsg[2][i:i + 4], sys.byteorder, signed=True)
           for cmsg in ancillary if cmsg[:2] == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
           for i in range(0, len(cmsg[2]) - 3, 4)]
    try:
        args = decode_request(data)
        if args is None or len(fds) != 3 or not args or args[0] != "hook":
            log.warning("malformed hook request refused")
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:  # pragma: no cover - the worker
            _work(server, conn, fds, args)
    finally:
        for fd in fds:
            os.close(fd)


def _work(server: socket.socket, conn: socket.socket, fds: list[int], args: list[str]) -> None:  # pragma: no cover
    status = 2
    try:
        server.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # the runtime's stdin (the OCI state), stdout, stderr
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from devinject.hook import main as hook

        hook.SERVED_BY = os.getppid()
        status = hook.main(args)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.settimeout(RECEIVE_TIMEOUT)
            conn.sendall(bytes([status & 0xFF]))
        finally:
            os._exit(0)
