"""MPS control daemons, one per GPU that a prepared claim shares through MPS: started with the driver's own
`nvidia-cuda-mps-control` (from the driver root) on the first claim, stopped on the last, started again when
it died, and nothing left behind when it stops (its pipe and log directories go with it).

Each GPU's daemon has its own root-owned directories, `<state dir>/mps/<PCI address>/{pipe,log}` (mode 0755:
clients connect to its socket; only root writes there), which the claim's CDI edits mount into the container
with `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY`. The daemon runs in the foreground (`-f`) in a
session of its own, so it outlives a restart of the agent; `daemons.json` records its pid and start time
(a pid alone could be reused) and the claims it serves, so a restarted agent adopts it rather than start a
second one. Every call to the control program has a deadline."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from devinject.core import jsonlite
from devinject.core.errors import DevinjectError
from devinject.linux.filelock import exclusive
from devinject.linux.trusteddir import make_dirs
from devinject.nodestate.ledger import process_start_time

log = logging.getLogger(__name__)

CONTROL = "usr/bin/nvidia-cuda-mps-control"  # under the driver root
STATE = "daemons.json"
QUIT_TIMEOUT = 10.0  # seconds for `quit` to be taken, and for the daemon to exit after it
START_TIMEOUT = 5.0  # seconds for a started daemon to be seen running
PIPE_IN_CONTAINER = "/tmp/nvidia-mps"  # where CUDA clients find the daemon, as NVIDIA's drivers mount it
LOG_IN_CONTAINER = "/var/log/nvidia-mps"
LOCK = ".daemons.lock"  # the device plugin and the DRA driver may both keep daemons on one node
LOCK_TIMEOUT = START_TIMEOUT + 2 * QUIT_TIMEOUT + 5.0  # a holder may be starting or stopping a daemon


class MpsError(DevinjectError):
    """A daemon that cannot be started or stopped: said in one line, the claim not prepared."""


@dataclass(frozen=True, slots=True)
class Daemon:
    gpu: str  # PCI address
    pipe_dir: str
    log_dir: str


class MpsDaemons:
    def __init__(self, state_dir: str, driver_root: str = "/", proc: str = "/proc") -> None:
        self.base = os.path.join(state_dir, "mps")
        self.control = os.path.join(driver_root, CONTROL)
        self.proc = proc

    # --- state --------------------------------------------------------------------------------------------
    def _load(self) -> dict[str, dict[str, object]]:
        """The recorded daemons; when the record is missing or broken, the daemons running from our
        directories, found in /proc (a second daemon must never be started over a live one's pipe)."""
        try:
            with open(os.path.join(self.base, STATE), encoding="utf-8") as handle:
                data = jsonlite.loads(handle.read())
        except FileNotFoundError:
            return self._found() if os.path.isdir(self.base) else {}
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not all(_entry_ok(v) for v in data.values()):
            log.warning("%s: broken; the MPS daemons are found again from /proc", os.path.join(self.base, STATE))
            return self._found()
        return data

    def _found(self) -> dict[str, dict[str, object]]:
        """GPU -> the daemon running with its pipe directory under ours (its holders are the checkpoint's
        claims again, at the driver's next round)."""
        found: dict[str, dict[str, object]] = {}
        try:
            pids = [int(n) for n in os.listdir(self.proc) if n.isdigit()]
        except OSError:
            return found
        for pid in pids:
            try:
                with open(f"{self.proc}/{pid}/cmdline", "rb") as handle:
                    argv = handle.read(4096).split(b"\0")
                if self.control.encode() not in argv[:2]:  # as we start it: the binary, or a script's interpreter
                    continue
                there, here = os.stat(f"{self.proc}/{pid}/root"), os.stat(f"{self.proc}/self/root")
                if (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino):
                    continue  # another root: a container's process naming itself so is not our daemon
                with open(f"{self.proc}/{pid}/environ", "rb") as handle:
                    env = dict(e.split(b"=", 1) for e in handle.read(65536).split(b"\0") if b"=" in e)
            except OSError:
                continue
            pipe = env.get(b"CUDA_MPS_PIPE_DIRECTORY", b"").decode(errors="replace")
            gpu = os.path.basename(os.path.dirname(pipe))
            start = process_start_time(pid, self.proc)
            if start is not None and pipe == self.daemon(gpu).pipe_dir:
                visible = env.get(b"CUDA_VISIBLE_DEVICES", b"").decode(errors="replace")
                found[gpu] = {"pid": pid, "start_time": start, "visible": visible, "holders": []}
        return found

    def _save(self, data: dict[str, dict[str, object]]) -> None:
        make_dirs(self.base, 0o755)
        jsonlite.replace_file(os.path.join(self.base, STATE), data)

    def _locked(self) -> exclusive:
        """Every read-modify-write of daemons.json under one lock: two agents' rounds would otherwise each
        save what they read, and the second would forget (and later start again) the first one's daemon."""
        make_dirs(self.base, 0o755)
        return exclusive(os.path.join(self.base, LOCK), timeout=LOCK_TIMEOUT, what="MPS daemons", error=MpsError)

    def daemon(self, gpu: str) -> Daemon:
        if "/" in gpu or gpu in ("", ".", ".."):
            raise MpsError(f"{gpu!r}: not a PCI address")
        top = os.path.join(self.base, gpu)
        return Daemon(gpu, os.path.join(top, "pipe"), os.path.join(top, "log"))

    def _alive(self, entry: dict[str, object]) -> bool:
        pid, start = entry.get("pid"), entry.get("start_time")
        return isinstance(pid, int) and pid > 1 and process_start_time(pid, self.proc) == start

    # --- the lifecycle --------------------------------------------------------------------------------------
    def acquire(self, gpu: str, holder: str, visible: str) -> Daemon:
        """The daemon for `gpu` (started if none runs), now serving `holder` (a claim); `visible` is what
        CUDA_VISIBLE_DEVICES names the GPU by on the host (its index or UUID)."""
        if not visible:
            raise MpsError(f"{gpu}: no name for the GPU to give its MPS daemon (CUDA_VISIBLE_DEVICES)")
        with self._locked():
            return self._acquire(gpu, holder, visible)

    def _acquire(self, gpu: str, holder: str, visible: str) -> Daemon:
        data = self._load()
        entry = data.get(gpu) or {}
        daemon = self.daemon(gpu)
        if not self._alive(entry):
            if entry.get("pid"):
                log.warning("MPS daemon of %s (pid %s) is gone: starting it again", gpu, entry.get("pid"))
            entry = {**self._start(daemon, visible), "holders": entry.get("holders", [])}
        holders = sorted(set(entry.get("holders", [])) | {holder})  # type: ignore[call-overload]
        data[gpu] = {**entry, "holders": holders}
        self._save(data)
        return daemon

    def release(self, gpu: str, holder: str) -> bool:
        """`holder` no longer needs the daemon; the last one stops it. Whether it was stopped."""
        with self._locked():
            return self._release(gpu, holder)

    def _release(self, gpu: str, holder: str) -> bool:
        data = self._load()
        entry = data.get(gpu)
        if entry is None:
            return False
        holders = [h for h in entry.get("holders", []) if h != holder]  # type: ignore[attr-defined]
        if holders:
            data[gpu] = {**entry, "holders": holders}
            self._save(data)
            return False
        self._stop(self.daemon(gpu), entry)
        del data[gpu]
        self._save(data)
        return True

    def check(self) -> list[str]:
        """Start again every daemon that died while claims still need it (the agent's rounds). The GPUs
        restarted."""
        if not os.path.isdir(self.base):
            return []  # no daemon was ever started here: nothing to lock, nor to look for in /proc
        with self._locked():
            return self._check()

    def _check(self) -> list[str]:
        data = self._load()
        restarted = []
        for gpu, entry in sorted(data.items()):
            if isinstance(entry.get("pid"), int):
                _reap(int(entry["pid"]))  # type: ignore[call-overload]  # a dead child of ours is a zombie, not alive
            if entry.get("holders") and not self._alive(entry):
                log.warning("MPS daemon of %s (pid %s) died: starting it again", gpu, entry.get("pid"))
                data[gpu] = {**entry, **self._start(self.daemon(gpu), str(entry.get("visible", "")))}
                restarted.append(gpu)
        if restarted:
            self._save(data)
        return restarted

    def recorded(self) -> dict[str, list[str]]:
        """GPU -> the claims its daemon serves, as recorded (alive or not)."""
        return {gpu: list(e.get("holders", [])) for gpu, e in self._load().items()}  # type: ignore[call-overload]

    def running(self) -> dict[str, list[str]]:
        """GPU -> the claims its live daemon serves."""
        return {gpu: list(e.get("holders", [])) for gpu, e in self._load().items()  # type: ignore[call-overload]
                if self._alive(e)}

    # --- the control program --------------------------------------------------------------------------------
    def _env(self, daemon: Daemon, visible: str) -> dict[str, str]:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
               "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir}
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return env

    def _start(self, daemon: Daemon, visible: str) -> dict[str, object]:
        if not os.access(self.control, os.X_OK):
            raise MpsError(f"{self.control}: the driver's MPS control program is not there; MPS cannot be used")
        for directory in (daemon.pipe_dir, daemon.log_dir):
            shutil.rmtree(directory, ignore_errors=True)  # a crashed daemon's leftovers
            make_dirs(directory, 0o755)
        try:
            process = subprocess.Popen([self.control, "-f"], env=self._env(daemon, visible), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            raise MpsError(f"{self.control}: cannot start: {err.strerror}") from None
        deadline = time.monotonic() + START_TIMEOUT
        control = os.path.join(daemon.pipe_dir, "control")  # the socket clients connect to: it is serving
        while not os.path.exists(control) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        start = process_start_time(process.pid, self.proc)
        if process.poll() is not None or start is None or not os.path.exists(control):
            status = process.poll()
            if status is None:
                process.kill()
                process.wait(2)
            raise MpsError(f"{self.control} -f for {daemon.gpu}: " + (
                f"exited at once (status {status})" if status is not None
                else f"no {control} after {START_TIMEOUT:g} s") + f"; see {daemon.log_dir}")
        log.info("MPS daemon of %s started (pid %d, pipe %s)", daemon.gpu, process.pid, daemon.pipe_dir)
        return {"pid": process.pid, "start_time": start, "visible": visible}

    def _stop(self, daemon: Daemon, entry: dict[str, object]) -> None:
        """`quit` through the control program, then TERM, then KILL, each with a deadline; the dirs go."""
        if self._alive(entry):
            try:
                subprocess.run([self.control], input=b"quit\n", env=self._env(daemon, str(entry.get("visible", ""))),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=QUIT_TIMEOUT, check=False)
            except (OSError, subprocess.TimeoutExpired) as err:
                log.warning("MPS daemon of %s: quit did not answer (%s)", daemon.gpu, err)
            pid = int(entry["pid"])  # type: ignore[call-overload]
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None and self._alive(entry):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                deadline = time.monotonic() + (QUIT_TIMEOUT if sig is None else 2.0)
                while self._alive(entry) and time.monotonic() < deadline:
                    _reap(pid)
                    time.sleep(0.02)
                if not self._alive(entry):
                    break
            _reap(pid)
        shutil.rmtree(os.path.join(self.base, daemon.gpu), ignore_errors=True)
        log.info("MPS daemon of %s stopped", daemon.gpu)


def _entry_ok(entry: object) -> bool:
    return (isinstance(entry, dict) and type(entry.get("pid")) is int and type(entry.get("start_time")) is int
            and isinstance(entry.get("holders"), list) and all(isinstance(h, str) for h in entry["holders"])
            and isinstance(entry.get("visible", ""), str))


def _reap(pid: int) -> None:
    """Our own child (started by this process) is reaped; another's is not ours to wait for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
