"""MPS control daemons, one per holder: a prepared DRA claim that shares a GPU through MPS, or one replica the
device plugin hands out (as NVIDIA's DRA driver runs one per claim). Each is the driver's own
`nvidia-cuda-mps-control` (resolved inside the driver root and only root's: agent/rootprogram.py), started with
its holder, stopped with it, started again when it died or when its `control` socket is not its own any more;
nothing is left behind when it stops. Two holders never share a daemon, a pipe directory or a server, even on
one GPU (consumable capacity packs claims of different namespaces onto one GPU).

Each daemon's directories, `pipe` and `log`, are on a small tmpfs of its own mounted at
`<state dir>/mps/<holder>` (root's, 0755, nosuid, nodev, noexec, MOUNT_OPTIONS bounds its bytes and inodes):
the claim's containers get `pipe` read-write (CUDA clients must write there) and `log` read-only, so a pod that
fills its pipe directory fills its own daemon's tmpfs, never the state dir (the ledger, the grants, the hook's
socket) nor another claim's. A per-holder tmpfs rather than one for all: a pod filling a shared one would stop
every other claim's daemon from writing its sockets.

A pod can still replace its own daemon's `control` socket (it writes the pipe directory); the socket's inode
is recorded when the daemon starts, and one replaced (or gone) is a hijacked daemon: `check()` does not call it
alive, kills it (never `quit` through the planted socket), empties the pipe directory (the same directory the
containers have mounted, so they reach the new daemon) and starts it again.

The daemon runs in the foreground (`-f`) in a session of its own, so it outlives a restart of the agent;
`daemons.json` records its pid and start time (a pid alone could be reused), its holder, GPU and socket, so a
restarted agent adopts it rather than start a second one; a broken record is rebuilt from /proc (the holder
and GPU are in the daemon's environment). Every call to the control program has a deadline."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass

from devinject.agent.rootprogram import UntrustedProgramError, root_program
from devinject.core import jsonlite
from devinject.core.errors import DevinjectError
from devinject.linux import libc, syscalls
from devinject.linux.filelock import exclusive
from devinject.linux.trusteddir import make_dirs, trusted_dir
from devinject.nodestate.ledger import process_start_time

log = logging.getLogger(__name__)

CONTROL = "/usr/bin/nvidia-cuda-mps-control"  # inside the driver root
STATE = "daemons.json"
QUIT_TIMEOUT = 10.0  # seconds for `quit` to be taken, and for the daemon to exit after it
START_TIMEOUT = 5.0  # seconds for a started daemon to be seen running
PIPE_IN_CONTAINER = "/tmp/nvidia-mps"  # where CUDA clients find the daemon, as NVIDIA's drivers mount it
LOG_IN_CONTAINER = "/var/log/nvidia-mps"
LOCK = ".daemons.lock"  # the device plugin and the DRA driver may both keep daemons on one node
LOCK_TIMEOUT = START_TIMEOUT + 2 * QUIT_TIMEOUT + 5.0  # a holder may be starting or stopping a daemon
# A daemon's sockets and logs take kilobytes; what a pod writes beyond these stays on its own tmpfs.
MOUNT_OPTIONS = "size=8m,nr_inodes=1024,mode=0755"
MOUNT_FLAGS = syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC
HOLDER_ENV = "DEVINJECT_MPS_HOLDER"  # in the daemon's environment: a lost record is found again from /proc
GPU_ENV = "DEVINJECT_MPS_GPU"
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")  # no dot: never daemons.json nor the lock


class MpsError(DevinjectError):
    """A daemon that cannot be started or stopped: said in one line, the claim not prepared."""


@dataclass(frozen=True, slots=True)
class Daemon:
    holder: str  # a claim's UID, or the device plugin's `device-plugin:<resource>:<replica>`
    top: str  # its tmpfs
    pipe_dir: str
    log_dir: str


def daemon_name(holder: str) -> str:
    """The directory name of `holder`'s daemon: the holder itself when it is a plain name (a claim's UID),
    else its plain characters and a digest (a device-plugin holder has `/`, `.` and `:`)."""
    if not holder:
        raise MpsError("an MPS daemon needs a holder")
    if _PLAIN.fullmatch(holder):
        return holder
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", holder)[:40].lstrip("._-") or "h"
    return f"{plain}-{hashlib.sha256(holder.encode()).hexdigest()[:16]}"


class MpsDaemons:
    def __init__(self, state_dir: str, driver_root: str = "/", proc: str = "/proc") -> None:
        self.base = os.path.join(state_dir, "mps")
        self.driver_root = driver_root
        self.control = os.path.join(driver_root, CONTROL.lstrip("/"))  # as named; what runs is resolved
        self.proc = proc

    # --- state --------------------------------------------------------------------------------------------
    def _load(self) -> dict[str, dict[str, object]]:
        return self._read()[0]

    def _read(self) -> tuple[dict[str, dict[str, object]], bool]:
        """The recorded daemons by name, and whether the record was missing or broken: then the daemons
        running from our directories, found in /proc (a second daemon must never be started over a live
        one's pipe)."""
        try:
            with open(os.path.join(self.base, STATE), encoding="utf-8") as handle:
                data = jsonlite.loads(handle.read())
        except FileNotFoundError:
            return (self._found(), True) if os.path.isdir(self.base) else ({}, False)
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not all(_entry_ok(k, v) for k, v in data.items()):
            log.warning("%s: broken; the MPS daemons are found again from /proc", os.path.join(self.base, STATE))
            return self._found(), True
        return data, False

    def _found(self) -> dict[str, dict[str, object]]:
        """Name -> the daemon running with its pipe directory under ours, its holder and GPU from its
        environment (set by us when it started; a pod cannot change a running process's)."""
        found: dict[str, dict[str, object]] = {}
        try:
            pids = [int(n) for n in os.listdir(self.proc) if n.isdigit()]
            program = (root_program(self.driver_root, CONTROL) or self.control).encode()
        except (OSError, UntrustedProgramError):
            return found
        for pid in pids:
            try:
                with open(f"{self.proc}/{pid}/cmdline", "rb") as handle:
                    argv = handle.read(4096).split(b"\0")
                if program not in argv[:2]:  # as we start it: the binary, or a script's interpreter
                    continue  # (its children have its environment too)
                there, here = os.stat(f"{self.proc}/{pid}/root"), os.stat(f"{self.proc}/self/root")
                if (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino):
                    continue  # another root: a container's process naming itself so is not our daemon
                with open(f"{self.proc}/{pid}/environ", "rb") as handle:
                    env = dict(e.split(b"=", 1) for e in handle.read(65536).split(b"\0") if b"=" in e)
            except OSError:
                continue
            holder = env.get(HOLDER_ENV.encode(), b"").decode(errors="replace")
            pipe = env.get(b"CUDA_MPS_PIPE_DIRECTORY", b"").decode(errors="replace")
            if not holder and os.path.dirname(os.path.dirname(pipe)) == self.base:
                log.warning("MPS daemon pid %d (pipe %s) is of the previous layout, one per GPU: left running for "
                            "the pods that use it; once they are gone, stop it with `echo quit | "
                            "CUDA_MPS_PIPE_DIRECTORY=%s nvidia-cuda-mps-control`", pid, pipe, pipe)
            if not holder or pipe != self.daemon(holder).pipe_dir:
                continue
            start = process_start_time(pid, self.proc)
            if start is None:
                continue
            found[daemon_name(holder)] = {
                "holder": holder, "gpu": env.get(GPU_ENV.encode(), b"").decode(errors="replace"), "pid": pid,
                "start_time": start, "visible": env.get(b"CUDA_VISIBLE_DEVICES", b"").decode(errors="replace"),
                "control": _identity(os.path.join(pipe, "control"))}  # as found: the record of it was lost
        return found

    def _save(self, data: dict[str, dict[str, object]]) -> None:
        jsonlite.replace_file(os.path.join(self.base, STATE), data)

    def _locked(self) -> exclusive:
        """Every read-modify-write of daemons.json under one lock: two agents' rounds would otherwise each
        save what they read, and the second would forget (and later start again) the first one's daemon."""
        trusted_dir(self.base, 0o755, what="MPS daemons' directory", error=MpsError)
        return exclusive(os.path.join(self.base, LOCK), timeout=LOCK_TIMEOUT, what="MPS daemons", error=MpsError)

    def daemon(self, holder: str) -> Daemon:
        """Where `holder`'s daemon lives (whether or not it runs)."""
        top = os.path.join(self.base, daemon_name(holder))
        return Daemon(holder, top, os.path.join(top, "pipe"), os.path.join(top, "log"))

    def _alive(self, entry: dict[str, object]) -> bool:
        pid, start = entry.get("pid"), entry.get("start_time")
        return isinstance(pid, int) and pid > 1 and process_start_time(pid, self.proc) == start

    def _hijacked(self, entry: dict[str, object]) -> bool:
        """The daemon's `control` socket is not the one it made: replaced (a pod wrote its pipe directory)
        or gone. Its clients would talk to whatever is there now."""
        now = _identity(os.path.join(self.daemon(str(entry.get("holder"))).pipe_dir, "control"))
        return now is None or now != entry.get("control")

    def _serving(self, entry: dict[str, object]) -> bool:
        return self._alive(entry) and not self._hijacked(entry)

    # --- the lifecycle --------------------------------------------------------------------------------------
    def acquire(self, gpu: str, holder: str, visible: str) -> Daemon:
        """`holder`'s own daemon for `gpu` (started if none runs); `visible` is what CUDA_VISIBLE_DEVICES
        names the GPU by on the host (its index or UUID)."""
        if not visible:
            raise MpsError(f"{gpu}: no name for the GPU to give its MPS daemon (CUDA_VISIBLE_DEVICES)")
        with self._locked():
            return self._acquire(gpu, holder, visible)

    def _acquire(self, gpu: str, holder: str, visible: str) -> Daemon:
        data = self._load()
        name = daemon_name(holder)
        entry = data.get(name) or {}
        daemon = self.daemon(holder)
        if entry and entry.get("gpu") != gpu:
            raise MpsError(f"{holder}: already has an MPS daemon, for {entry.get('gpu')}; not for {gpu} too")
        if not self._serving(entry):
            if entry:
                self._kill(daemon, entry)
                log.warning("MPS daemon of %s (pid %s) is gone or not its own: starting it again", holder,
                            entry.get("pid"))
            try:
                entry = {"holder": holder, "gpu": gpu, **self._start(daemon, gpu, visible)}
            except MpsError:
                if name not in data:
                    self._unmount(daemon)  # nothing of a daemon that never ran is left
                raise
            data[name] = entry
            self._save(data)
        return daemon

    def release(self, gpu: str, holder: str) -> bool:
        """`holder` no longer needs its daemon: stopped, its tmpfs gone. Whether one was recorded."""
        with self._locked():
            data = self._load()
            entry = data.pop(daemon_name(holder), None)
            if entry is None:
                return False
            self._stop(self.daemon(holder), entry)
            self._save(data)
            return True

    def check(self) -> list[str]:
        """Start again every daemon that died, or whose `control` socket was replaced (the agent's rounds).
        The holders whose daemon was restarted."""
        if not os.path.isdir(self.base):
            return []  # no daemon was ever started here: nothing to lock, nor to look for in /proc
        with self._locked():
            return self._check()

    def _check(self) -> list[str]:
        data, rebuilt = self._read()
        restarted = []
        for name, entry in sorted(data.items()):
            if isinstance(entry.get("pid"), int):
                _reap(int(entry["pid"]))  # type: ignore[call-overload]  # a dead child of ours is a zombie, not alive
            if self._serving(entry):
                continue
            holder, gpu = str(entry["holder"]), str(entry["gpu"])
            daemon = self.daemon(holder)
            if self._alive(entry):
                log.warning("MPS daemon of %s on %s (pid %s): its control socket %s was replaced; the daemon is "
                            "stopped and started again", holder, gpu, entry.get("pid"),
                            os.path.join(daemon.pipe_dir, "control"))
                self._kill(daemon, entry)
            else:
                log.warning("MPS daemon of %s on %s (pid %s) died: starting it again", holder, gpu, entry.get("pid"))
            data[name] = {**entry, **self._start(daemon, gpu, str(entry.get("visible", "")))}
            restarted.append(holder)
        if restarted or rebuilt:
            self._save(data)
        return restarted

    def recorded(self) -> dict[str, list[str]]:
        """GPU -> the holders of its recorded daemons (alive or not)."""
        out: dict[str, list[str]] = {}
        for entry in self._load().values():
            out.setdefault(str(entry.get("gpu")), []).append(str(entry.get("holder")))
        return {gpu: sorted(holders) for gpu, holders in out.items()}

    def running(self) -> dict[str, list[str]]:
        """GPU -> the holders whose daemon is alive and serves its own socket."""
        out: dict[str, list[str]] = {}
        for entry in self._load().values():
            if self._serving(entry):
                out.setdefault(str(entry.get("gpu")), []).append(str(entry.get("holder")))
        return {gpu: sorted(holders) for gpu, holders in out.items()}

    # --- the directories ------------------------------------------------------------------------------------
    def _mounted(self, top: str) -> bool:
        try:
            return os.lstat(top).st_dev != os.lstat(self.base).st_dev
        except OSError:
            return False

    def _prepare(self, daemon: Daemon) -> None:
        """The daemon's tmpfs (mounted once, kept across restarts of the daemon: running containers have
        its `pipe` mounted), with `pipe` and `log` emptied of what a crashed daemon or a pod left."""
        if not self._mounted(daemon.top):
            make_dirs(daemon.top, 0o755)
            try:
                _mount_tmpfs(daemon.top)
            except OSError as err:
                raise MpsError(f"{daemon.top}: cannot mount the MPS daemon's tmpfs: "
                               f"{os.strerror(err.errno or errno.EIO)} (MPS needs CAP_SYS_ADMIN)") from None
        for directory in (daemon.pipe_dir, daemon.log_dir):
            try:
                st = os.lstat(directory)
            except FileNotFoundError:
                make_dirs(directory, 0o755)
                continue
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(directory)
                make_dirs(directory, 0o755)
                continue
            _empty(directory)
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, 0o755)  # a pod may have changed it
            finally:
                os.close(fd)

    def _unmount(self, daemon: Daemon) -> None:
        while self._mounted(daemon.top):  # stacked mounts too
            try:
                syscalls.umount(daemon.top, syscalls.MNT_DETACH)
            except OSError as err:
                log.warning("%s: cannot unmount: %s", daemon.top, err)
                break
        shutil.rmtree(daemon.top, ignore_errors=True)

    # --- the control program --------------------------------------------------------------------------------
    def _program(self) -> str:
        try:
            program = root_program(self.driver_root, CONTROL)
        except UntrustedProgramError as err:
            raise MpsError(err.message) from None
        if program is None:
            raise MpsError(f"{self.control}: the driver's MPS control program is not there; MPS cannot be used")
        return program

    def _env(self, daemon: Daemon, gpu: str, visible: str) -> dict[str, str]:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
               "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir, HOLDER_ENV: daemon.holder, GPU_ENV: gpu}
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return env

    def _start(self, daemon: Daemon, gpu: str, visible: str) -> dict[str, object]:
        program = self._program()
        self._prepare(daemon)
        try:
            process = subprocess.Popen([program, "-f"], env=self._env(daemon, gpu, visible),
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            raise MpsError(f"{program}: cannot start: {err.strerror}") from None
        deadline = time.monotonic() + START_TIMEOUT
        control = os.path.join(daemon.pipe_dir, "control")  # the socket clients connect to: it is serving
        while not os.path.lexists(control) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        start = process_start_time(process.pid, self.proc)
        identity = _identity(control)
        if process.poll() is not None or start is None or identity is None:
            status = process.poll()
            if status is None:
                process.kill()
                process.wait(2)
            raise MpsError(f"{program} -f for {gpu} ({daemon.holder}): " + (
                f"exited at once (status {status})" if status is not None
                else f"no {control} after {START_TIMEOUT:g} s") + f"; see {daemon.log_dir}")
        log.info("MPS daemon of %s on %s started (pid %d, pipe %s)", daemon.holder, gpu, process.pid,
                 daemon.pipe_dir)
        return {"pid": process.pid, "start_time": start, "visible": visible, "control": identity}

    def _stop(self, daemon: Daemon, entry: dict[str, object]) -> None:
        """`quit` through the control program (only to the daemon's own socket), then TERM, then KILL, each
        with a deadline; its tmpfs is unmounted."""
        if self._serving(entry):
            try:
                subprocess.run([self._program()], input=b"quit\n",
                               env=self._env(daemon, str(entry.get("gpu")), str(entry.get("visible", ""))),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=QUIT_TIMEOUT, check=False)
            except (OSError, subprocess.TimeoutExpired, MpsError) as err:
                log.warning("MPS daemon of %s: quit did not answer (%s)", daemon.holder, err)
            self._wait(entry, QUIT_TIMEOUT)
        self._kill(daemon, entry)
        self._unmount(daemon)
        log.info("MPS daemon of %s stopped", daemon.holder)

    def _kill(self, daemon: Daemon, entry: dict[str, object]) -> None:
        """TERM, then KILL, each with a deadline."""
        pid = entry.get("pid")
        if not isinstance(pid, int) or pid <= 1:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._alive(entry):
                break
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            self._wait(entry, 2.0)
        _reap(pid)

    def _wait(self, entry: dict[str, object], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._alive(entry) and time.monotonic() < deadline:
            _reap(int(entry["pid"]))  # type: ignore[call-overload]
            time.sleep(0.02)


def _entry_ok(name: object, entry: object) -> bool:
    return (isinstance(entry, dict) and type(entry.get("pid")) is int and type(entry.get("start_time")) is int
            and isinstance(entry.get("holder"), str) and bool(entry["holder"]) and isinstance(entry.get("gpu"), str)
            and name == daemon_name(entry["holder"]) and isinstance(entry.get("visible", ""), str)
            and (entry.get("control") is None or (isinstance(entry["control"], list) and len(entry["control"]) == 2
                                                  and all(type(n) is int for n in entry["control"]))))


def _identity(path: str) -> list[int] | None:
    """The file at `path` as [device, inode] (never through a link); None when nothing is there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def _mount_tmpfs(target: str) -> None:
    result = libc.function("mount")(b"tmpfs", target.encode(), b"tmpfs", libc.Long(MOUNT_FLAGS),
                                    MOUNT_OPTIONS.encode())
    if result != 0:
        err = libc.errno()
        raise OSError(err, os.strerror(err))


def _empty(directory: str) -> None:
    """Everything in `directory` removed, never following a link out of it."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass


def _reap(pid: int) -> None:
    """Our own child (started by this process) is reaped; another's is not ours to wait for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
