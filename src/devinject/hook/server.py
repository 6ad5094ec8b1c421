"""`devinject hook-server`: a resident process the hook hands its invocation to (hook/client.py).

What it saves is what every container start pays before doing any work: the hook's imports, ctypes
and the executor's. It keeps no state of its own: each request is served by a worker forked from the server
in advance (a single-threaded process, so it may join namespaces), which runs exactly what the hook runs
in-process — the same arguments, the same config file, specs, ledger and log, with the
runtime's own stdin, stdout and stderr passed over the socket — and reports the exit status. A worker that
served a cdi-hook goes back to its own mount namespace, root, working directory, umask, streams and file
descriptors, checks that it did, and waits for the next request; after an OCI `hook` or a request that failed
it exits (see `_serve_requests`).

Only a peer running as the server's own user is served (SO_PEERCRED), and the socket is created mode 0600
in a directory only that user can write. Only a peer in the server's own pid, mount, user and network
namespaces is served: the OCI state's pid, its bundle and the hook's paths mean what they mean to the runtime
that ran the hook, so a runtime elsewhere (a nested pid namespace: Docker-in-Docker, kind) is answered
REFUSED before anything is done, and its hook runs in-process. A new devinject version takes effect when
the server restarts.

A `cdi-hook` (a spec's createContainer hook) runs in the container's mount namespace, before `pivot_root`,
and often in its pid and network namespaces too (runc runs it from the container's init): its paths mean
what they mean there. Its peer must share the server's user namespace only (the files it makes are owned as
the in-process hook's would be) and its root must be the server's `/` (a hook runs before `pivot_root`; a
process inside a running container that reached the socket has the container's root); the worker joins the
peer's own mount namespace, root and working directory, held while the peer is checked alive, and runs
exactly the in-process `run_cdi_hook` there, confined to the rootfs by the same code, then returns to its
own (`Home.restore`). Any other peer is answered REFUSED.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable

from devinject.core.errors import DevinjectError
from devinject.hook.client import MAX_REQUEST, REFUSED, decode_request
from devinject.linux import syscalls
from devinject.linux.trusteddir import trusted_dir

log = logging.getLogger("devinject.hook-server")

# What a container start loads: imported once here, so no worker imports anything.
PRELOAD = ("devinject.hook.main", "devinject.hook.cdihook", "devinject.hook.state", "devinject.hook.request",
           "devinject.hook.registry", "devinject.hook.plan", "devinject.hook.nsenter", "devinject.hook.executor",
           "devinject.hook.cgroup", "devinject.hook.bpf", "devinject.nodestate.ledger",
           "devinject.nodestate.profilefacts", "devinject.nodestate.evidence", "devinject.core.asciitext")
RECEIVE_TIMEOUT = 5.0
SPARES = 3  # workers waiting for a request: container starts come in bursts, and a poststop takes one too
REPLACE_AFTER = 0.2  # seconds after the last request before replacing the workers that took one
MAX_WORKERS = 32  # waiting and busy: beyond, the server answers REFUSED and the hook runs in-process
RETIRE_AFTER = 5.0  # seconds a worker forked for a burst waits for another request before it exits
MAX_REQUESTS = 1000  # a worker's, before it exits and a fresh one is forked (what it made of its copy of the heap)
CODE_CHANGED_STATUS = 3  # the server's exit when devinject was reinstalled under it: its service restarts it
PR_SET_PDEATHSIG = 1
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# What the OCI state and the hook's arguments are read in: the pid, the bundle and spec paths, the uid the
# nodes are made for, and the host interfaces a netDevices edit moves.
NAMESPACES = ("pid", "mnt", "user", "net")
CDI_HOOK_NAMESPACES = ("user",)  # a cdi-hook's peer is in the container's others: the worker joins its mount
CDI_HOOK_TIMEOUT = 30.0  # the in-process hook's deadline in a container's namespace (hook/nsenter.py)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5: a pidfd of the very process that connected

Namespaces = tuple[tuple[int, int], ...]  # (st_dev, st_ino) of each of NAMESPACES


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from devinject.hook import fastjson, fastlibc
    from devinject.linux import libc

    fastjson.install()  # what hook/main installs: the workers' requests find it in place, nothing cleared
    fastlibc.install()
    libc.function("syscall")  # the C library, loaded once


def listen(path: str) -> socket.socket:
    """The server socket at `path`: its directory created (0755 whatever the umask) when missing, and refused
    when others could change it or a directory above it (linux/trusteddir); a stale socket replaced, anything
    else at `path` refused."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise DevinjectError(f"{path}: too long for a unix socket ({MAX_SOCKET_PATH} bytes at most)")
    directory = os.path.dirname(os.path.abspath(path))
    trusted_dir(directory, what="hook server's directory")  # whoever could change it could swap the socket
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


def serve(path: str, *, spares: int = SPARES) -> None:
    """Serve hook requests on `path` until SIGTERM (from the main thread).

    Pre-forking: `spares` workers wait for a connection on the socket (epoll, exclusive wake-ups). A worker
    serves cdi-hooks (the spec's createContainer hook, on every container start of a runtime that applies
    CDI) one after another: it joins each peer's mount namespace, root and working directory and goes back
    to its own after answering.
    Forking a worker per request cost each one ~3-4 ms of CPU in the fork, the exit and the copy-on-write
    faults of a fresh copy of the heap: more than the hook's imports the server spares (bench_cdi_hooks:
    the server's CPU per request 6.5-7.2 ms, now 3.0-3.8). A worker exits after an OCI `hook` (its
    full run, cgroups, the ledger and all, is left as it was: one process per request), after any request that
    failed, and after MAX_REQUESTS; the server forks replacements once requests have paused for
    REPLACE_AFTER (at once when none waits: those exit again after RETIRE_AFTER without a request), so a
    fork (~2 ms for a process with everything loaded) is neither on a container's start path nor competing
    with it for the CPU. A replacement forked while another worker waits readies itself (~0.5 ms) at idle
    priority, and a worker that exits does so at idle priority: runc and the next container start come
    first. A worker copies only the server's pages that its requests write (copy-on-write, a reference count
    at a time): taking copies of the whole heap in advance cost each request ~8-10 ms of CPU to spare its
    start ~1 ms (bench_cdi_hooks: the server's CPU per request 15-17 against 7 ms).

    A devinject reinstalled or upgraded under a running server (its package's `__init__.py` replaced) is not
    served by the old code: the specs the new one writes may carry what the old cannot read (a flag it does not
    know), so from then on every request is answered REFUSED, to run in-process with the new code, and the
    server exits with CODE_CHANGED_STATUS within a second, for its service to start the new one."""
    global STARTED_CODE
    preload()
    STARTED_CODE = code_identity()  # the workers, forked from here, compare with it
    own = namespaces_of("self")
    server = listen(path)
    server.setblocking(False)  # the workers wait in epoll, and one woken for a connection another took goes on
    gc.freeze()  # what preloading made is never collected: no collection in a worker touches (copies) it
    background = _may_leave_idle_priority()
    taken_r, taken_w = os.pipe()  # a worker says with its pid that it took a request, negated that it is back
    idle: set[int] = set()
    busy: set[int] = set()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    log.info("hook server on %s", path)
    try:
        last_taken = 0.0
        while True:
            # Replace a worker that took a request and did not come back once the container start it served is
            # over (a fork then competes with it for the CPU), at once when none waits; one forked while all
            # were busy is temporary: it exits once the burst is over.
            settled = time.monotonic() - last_taken >= REPLACE_AFTER
            while len(idle) < spares and (settled or not idle) and len(idle) + len(busy) < MAX_WORKERS:
                idle.add(_spawn(server, taken_w, own, background=background and bool(idle),
                                temporary=len(idle) + len(busy) >= spares))
            capped = len(idle) + len(busy) >= MAX_WORKERS  # no fork until a worker comes back or exits
            wait = 0.5 if len(idle) >= spares or capped else max(REPLACE_AFTER - (time.monotonic() - last_taken),
                                                                0.001)
            # Every worker busy (a slow hook holds one up to CDI_HOOK_TIMEOUT, and a hostile image's library
            # folder can be slow): a request waiting for one would wait on other tenants' hooks, so it runs
            # in-process instead.
            full = not idle and len(busy) >= MAX_WORKERS
            readable, _, _ = select.select([taken_r, server.fileno()] if full else [taken_r], [], [], wait)
            if server.fileno() in readable:
                _refuse_waiting(server)
            if taken_r in readable:
                data = os.read(taken_r, 4096)
                for i in range(0, len(data) - 3, 4):
                    worker = int.from_bytes(data[i:i + 4], sys.byteorder, signed=True)
                    if worker > 0:
                        last_taken = time.monotonic()
                        idle.discard(worker)
                        busy.add(worker)
                    elif -worker in busy:
                        busy.discard(-worker)
                        idle.add(-worker)
            for pid in _reap():
                idle.discard(pid)  # a worker that exited: after a request it does not come back from, or died
                busy.discard(pid)
            if code_changed():
                log.warning("devinject changed on disk since this hook server started: exiting, for its service to "
                            "start the new one (requests meanwhile run in-process)")
                raise SystemExit(CODE_CHANGED_STATUS)
    finally:
        for pid in idle:  # a busy one answers first: it gets the server's end as SIGTERM (PDEATHSIG) after
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        server.close()
        os.close(taken_r)
        os.close(taken_w)
        try:
            os.unlink(path)
        except OSError:
            pass
        _reap()


def _refuse_waiting(server: socket.socket) -> None:
    """Answer REFUSED to the connections waiting on `server` (nothing read from them: their hooks run in-process)."""
    while True:
        try:
            conn, _ = server.accept()
        except (BlockingIOError, InterruptedError):
            return  # none left, or a worker came back and took it
        except OSError as err:
            log.warning("hook server: accept: %s", err)
            return
        with conn:
            try:
                conn.setblocking(False)  # REFUSED fits any socket buffer: a peer that does not read waits for no one
                conn.send(REFUSED)
            except OSError:
                pass  # it hung up: its hook runs in-process either way
        log.warning("all %d hook workers busy: request refused, to be run in-process", MAX_WORKERS)


STARTED_CODE: tuple[int, int, int] | None = None  # code_identity() when serve() started


def code_identity() -> tuple[int, int, int] | None:
    """The installed devinject's identity: its package's `__init__.py` (device, inode, mtime), which a reinstall
    or an upgrade replaces; None when it cannot be read."""
    import devinject

    try:
        st = os.stat(os.path.join(os.path.dirname(os.path.abspath(devinject.__file__)), "__init__.py"))
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def code_changed() -> bool:
    """Whether the package serve() started with has been replaced (never, when its identity was not read)."""
    return STARTED_CODE is not None and code_identity() != STARTED_CODE


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)  # through serve()'s cleanup: idle workers stopped, the socket removed


def _reap() -> list[int]:
    gone = []
    try:
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
            gone.append(pid)
    except ChildProcessError:
        pass
    return gone


def _may_leave_idle_priority() -> bool:
    """Whether a worker may go back from idle to normal scheduling priority (root, or CAP_SYS_NICE): tried
    in a child, so this process never stays idle."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _idle_priority() -> None:  # pragma: no cover - runs in a worker
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass  # only a matter of who runs first


def _spawn(server: socket.socket, taken_w: int, own: Namespaces, *, background: bool = False,
           temporary: bool = False) -> int:
    """A worker: it readies itself (at idle priority when `background`, back to normal before it waits for
    a request) and serves requests until one it may not come back from (see `_serve_requests`); a `temporary`
    one (forked while every worker was busy) exits once it has waited RETIRE_AFTER for a request."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    status = 1  # pragma: no cover - the worker, from here on
    try:
        if background:
            _idle_priority()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from devinject.linux import libc

        libc.function("prctl")(PR_SET_PDEATHSIG, libc.Long(signal.SIGTERM))  # never outlive the server
        if os.getppid() != parent:
            os._exit(0)
        if background:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # the request is served at full speed
        _serve_requests(server, taken_w, own, temporary=temporary)
        status = 0
    except BaseException as err:  # a worker never raises into the server's code
        log.warning("hook request dropped: %s", err)
    finally:
        _idle_priority()  # answered (or dropped): tearing this process down can wait for runc
        os._exit(status)


def _serve_requests(server: socket.socket, taken_w: int, own: Namespaces, *,
                    temporary: bool) -> None:  # pragma: no cover - runs in a worker
    """A worker's requests, one after another, each announced to the server (`taken_w`: its pid when it takes
    one, the pid negated when it is back waiting). It comes back only from a request that left nothing behind:
    a probe, a refusal, or a cdi-hook that succeeded and after which `Home.restore` put its mount namespace,
    root, working directory, umask, standard streams, signals and file descriptors back as they were and
    checked them so (and it imported no module); it exits after an OCI `hook` (the in-process hook's full
    run), after any request that failed, and after MAX_REQUESTS."""
    waiting = select.epoll()  # exclusive: a connection wakes one waiting worker, not all of them
    waiting.register(server.fileno(), select.EPOLLIN | select.EPOLLEXCLUSIVE)
    home = Home()  # after the epoll: its descriptor is the worker's own, not a request's
    me = os.getpid()

    def let_go() -> None:  # of the server's socket and pipe, before a request this worker exits after
        waiting.close()
        server.close()
        os.close(taken_w)

    for _ in range(MAX_REQUESTS):
        conn = _next_connection(server, waiting, RETIRE_AFTER if temporary else None)
        if conn is None:
            return  # a burst's extra worker, no longer needed
        os.write(taken_w, me.to_bytes(4, sys.byteorder, signed=True))
        with conn:
            again = _take(conn, own, home, last=let_go)
        if not again or not home.restore():
            return
        os.write(taken_w, (-me).to_bytes(4, sys.byteorder, signed=True))


def _next_connection(server: socket.socket, waiting: select.epoll,
                     patience: float | None) -> socket.socket | None:  # pragma: no cover - runs in a worker
    """The next connection on the (non-blocking) server socket, or None once `patience` seconds pass without
    one. Non-blocking, so that a worker woken for a connection another one took waits again rather than
    blocking in accept() past its patience."""
    deadline = None if patience is None else time.monotonic() + patience
    while True:
        left = -1.0 if deadline is None else deadline - time.monotonic()
        if deadline is not None and left <= 0:
            return None
        if not waiting.poll(left):
            continue
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            continue  # another worker took it
        conn.setblocking(True)
        return conn


class Home:  # pragma: no cover - runs in a worker
    """What a worker is when it waits for a request, saved to return to after serving a cdi-hook in a container's
    mount namespace: its own mount namespace, root and working directory (held open), its umask, its standard
    streams (the server's), its open file descriptors, and the modules it has loaded: a module imported during
    a request was read in the peer's mount namespace, whose files are not necessarily the host's, so a worker
    that imported one serves nothing more (PRELOAD has what a cdi-hook imports)."""

    def __init__(self) -> None:
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        self.mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.root = os.open("/", flags)
        self.cwd = os.open(".", flags)
        self.streams = [os.dup(fd) for fd in (0, 1, 2)]  # inheritable=False: close-on-exec
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.fds = _open_fds()
        self.identity = _identity()
        self.modules = set(sys.modules)

    def close(self) -> None:
        for fd in (self.mnt, self.root, self.cwd, *self.streams):
            os.close(fd)

    def put_back_streams(self) -> None:
        """The server's stdin, stdout and stderr back on 0, 1 and 2 (a request's were the runtime's)."""
        for target, fd in enumerate(self.streams):
            os.dup2(fd, target)

    def restore(self) -> bool:
        """This worker as it was before the request, checked: False (the worker must exit) when anything is not."""
        try:
            syscalls.setns(self.mnt, syscalls.CLONE_NEWNS)
            os.fchdir(self.root)
            os.chroot(".")
            os.fchdir(self.cwd)
        except OSError as err:
            log.warning("hook worker: cannot return to its own mount namespace: %s", err)
            return False
        os.umask(self.umask)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        self.put_back_streams()
        for fd in _open_fds() - self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        return _identity() == self.identity and _open_fds() == self.fds and sys.modules.keys() == self.modules


def _open_fds() -> set[int]:  # pragma: no cover - runs in a worker
    """This process's open file descriptors (not the one listing them)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
            found.add(int(name))
        except OSError:
            pass  # the directory's own, closed by now
    return found


def _identity() -> tuple[object, ...]:  # pragma: no cover - runs in a worker
    """This process's mount namespace, root, working directory and umask, as a request may not leave them."""
    umask = os.umask(0o022)
    os.umask(umask)
    return (*(((st := os.stat(path)).st_dev, st.st_ino) for path in ("/proc/self/ns/mnt", "/", ".")), umask)


def namespaces_of(pid: int | str, *, proc: str = "/proc") -> Namespaces:
    """The identity of process `pid`'s NAMESPACES (OSError when they cannot be read: gone, a zombie)."""
    found = []
    for kind in NAMESPACES:
        st = os.stat(f"{proc}/{pid}/ns/{kind}")
        found.append((st.st_dev, st.st_ino))
    return tuple(found)


def refusal(conn: socket.socket, pid: int, own: Namespaces, *, shared: tuple[str, ...] = NAMESPACES,
            hold: list[int] | None = None) -> str | None:
    """Why the peer on `conn`, which connected as `pid` (SO_PEERCRED: 0 when its pid namespace is no
    descendant of this one), is not served: None when its namespaces named in `shared` are `own`'s. With
    `hold`, its mount namespace, root and working directory are opened into it while the peer is held (a
    cdi-hook's: the worker joins them), so they are that very process's.

    Pid reuse cannot pass another process off as the peer: the peer is held as a pidfd (SO_PEERPIDFD) and
    its namespaces count only if it has not exited once they are read, so the pid still named it then.
    Without SO_PEERPIDFD (Linux < 6.5) the pidfd is opened from the number, which names another process
    only if the peer exited before that and left its end of the connection open in some other process: a
    connection whose peer hung up is refused."""
    if pid <= 0:
        return "its pid namespace is not the hook server's"
    pidfd = _peer_pidfd(conn, pid)
    if pidfd == -1:
        return f"pid {pid} is gone"
    try:
        try:
            theirs = namespaces_of(pid)
            if hold is not None:
                for what, flags in (("ns/mnt", os.O_RDONLY), ("root", os.O_PATH), ("cwd", os.O_PATH)):
                    hold.append(os.open(f"/proc/{pid}/{what}", flags | os.O_CLOEXEC))
                root_is_ours = _same_file(os.fstat(hold[1]), os.stat("/"))
        except OSError as err:
            return f"pid {pid}: its namespaces: {err.strerror}"
        if pidfd is not None and _ended(pidfd):
            return f"pid {pid} is gone"
    finally:
        if pidfd is not None:
            os.close(pidfd)
    if _ended(conn.fileno(), select.POLLRDHUP):
        return f"pid {pid} hung up"
    if hold is not None and not root_is_ours:  # a createContainer hook runs before pivot_root, on the host's /
        return f"pid {pid}: its root is not the host's (a process inside a container, not a runtime's hook)"
    different = [kind for kind, mine, its in zip(NAMESPACES, own, theirs, strict=True)
                 if mine != its and kind in shared]
    if different:
        return f"pid {pid} is not in the hook server's namespaces ({', '.join(different)})"
    return None


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _peer_pidfd(conn: socket.socket, pid: int) -> int | None:
    """A pidfd of the peer: -1 when it has gone already, None when the kernel has no pidfds (Linux < 5.3)."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass  # Linux < 6.5
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except (OSError, AttributeError):
        return None


def _ended(fd: int, events: int = select.POLLIN) -> bool:
    """Whether `fd` says now that its process exited (a pidfd) or its peer hung up (a socket, POLLRDHUP)."""
    poller = select.poll()
    poller.register(fd, events)
    return any(ready & (events | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ready in poller.poll(0))


def _take(conn: socket.socket, own: Namespaces, home: Home,
          last: Callable[[], None]) -> bool:  # pragma: no cover - runs in a worker
    """Serve the request on `conn`; whether this worker may take another (see `_serve_requests`). `last` is
    called before a request it will not come back from runs (it lets go of the server's socket and pipe)."""
    peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid = int.from_bytes(peer[0:4], sys.byteorder, signed=True)
    uid = int.from_bytes(peer[4:8], sys.byteorder)
    if uid != os.geteuid():
        log.warning("hook request from uid %d refused", uid)
        return True
    conn.settimeout(RECEIVE_TIMEOUT)
    data, ancillary, _, _ = conn.recvmsg(MAX_REQUEST + 4, socket.CMSG_SPACE(3 * 4))
    fds = [int.from_bytes(cmsg[2][i:i + 4], sys.byteorder, signed=True)
           for cmsg in ancillary if cmsg[:2] == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
           for i in range(0, len(cmsg[2]) - 3, 4)]
    if not data and not ancillary:
        return True  # a probe (`install-hook` asking whether a server answers), not a request
    args = decode_request(data)
    if args is None or len(fds) != 3 or not args or args[0] not in ("hook", "cdi-hook"):
        for fd in fds:
            os.close(fd)
        log.warning("malformed hook request refused")
        return True
    cdi_hook = args[0] == "cdi-hook"
    place: list[int] = []  # a cdi-hook's: the peer's mount namespace, root and working directory
    why = ("devinject changed on disk since this hook server started (it restarts)" if code_changed() else
           refusal(conn, pid, own, shared=CDI_HOOK_NAMESPACES if cdi_hook else NAMESPACES,
                   hold=place if cdi_hook else None))
    if why is not None:  # before anything is done: the hook runs in-process, in the runtime's namespaces
        for fd in fds + place:
            os.close(fd)
        log.warning("hook request refused, to be run in-process: %s", why)
        conn.sendall(REFUSED)
        return True
    if cdi_hook:  # while this worker's stderr is still the server's
        log.info("cdi-hook served for pid %d by worker %d", pid, os.getpid())
    else:
        last()  # the OCI hook's full run, as in-process: this worker exits after it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)  # the runtime's stdin (the OCI state), stdout, stderr
        os.close(fd)
    status = 2
    try:
        from devinject.hook import main as hook

        hook.SERVED_BY = os.getppid()
        status = _run_cdi_hook_in(place, args, pid) if cdi_hook else hook.main(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Let go of the runtime's pipes before answering: the runtime reads the hook's output to its end,
        # and would otherwise wait for this worker's exit too, not just the hook's.
        home.put_back_streams()
        conn.settimeout(RECEIVE_TIMEOUT)
        conn.sendall(bytes([status & 0xFF]))
    return cdi_hook and status == 0


def _run_cdi_hook_in(place: list[int], args: list[str], pid: int) -> int:  # pragma: no cover - in a worker
    """`args` (a cdi-hook) as the peer `pid` would have run it: in its mount namespace, root and working
    directory (`place`), within the in-process hook's deadline. The worker returns to its own with
    `Home.restore` afterwards, and exits when it cannot."""
    from devinject.core.errors import HookError
    from devinject.hook import main as hook

    mnt, root, cwd = place
    try:
        syscalls.setns(mnt, syscalls.CLONE_NEWNS)
        os.fchdir(root)
        os.chroot(".")
        os.fchdir(cwd)
    except OSError as err:
        print(f"devinject: error: cdi-hook: cannot join process {pid}'s mount namespace: "
              f"{os.strerror(err.errno or 0)}", file=sys.stderr)
        return 1
    finally:
        for fd in place:
            os.close(fd)

    def out_of_time(signum: int, frame: object) -> None:
        raise HookError(f"cdi-hook: the work in the container's mount namespace did not finish in "
                        f"{CDI_HOOK_TIMEOUT:g}s")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, CDI_HOOK_TIMEOUT)
    try:
        return hook.main(args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
