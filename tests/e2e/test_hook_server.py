"""`devinject hook-server` under real runc: the hook hands its invocation over (arguments and the runtime's
own stdin, stdout and stderr) and exits with the worker's status; without a server it runs in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Bundle, container_name, terminate
from tests.e2e.test_nsenter import container, single_threaded

pytestmark = pytest.mark.live
DEVINJECT = str(Path(sys.executable).parent / "devinject")
container = container  # a process in a mount namespace of its own (test_nsenter.py's fixture)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    path = Path(f"/tmp/di-hs-{os.getpid()}-{tmp_path.name[-12:]}") / "hook.sock"  # a short socket path
    log = tmp_path / "hook-server.log"
    with open(log, "w") as errors:
        process = subprocess.Popen([DEVINJECT, "hook-server", "--socket", str(path)], stderr=errors, text=True)
    try:
        for _ in range(400):
            if path.exists() or process.poll() is not None:
                break
            time.sleep(0.025)
        assert path.exists(), log.read_text()
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        yield process, path
    finally:
        running = process.poll() is None
        terminate(process, timeout=10)  # SIGKILL after the bound: never left running (its workers follow it)
        assert not running or process.returncode == 0, f"the server did not stop on SIGTERM: {process.returncode}"
        assert not (running and path.exists())  # on SIGTERM the server removes its socket
        if path.parent.exists():
            for leftover in path.parent.iterdir():
                leftover.unlink()
            path.parent.rmdir()


def test_a_served_hook_injects_the_device_and_logs_who_served_it(bundle: Bundle, server) -> None:  # type: ignore[no-untyped-def]
    process, path = server
    bundle.use_server(path)
    bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0; grep -c libcuda /proc/mounts"],
                annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "c3:0" and int(done.stdout.split()[1]) >= 1
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert record["result"] == "ok" and record["server"] == process.pid


def test_a_served_error_reaches_the_runtime_as_the_hooks_own(bundle: Bundle, server) -> None:  # type: ignore[no-untyped-def]
    _, path = server
    bundle.use_server(path)
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=99"})
    done = bundle.run(container_name())
    assert done.returncode != 0
    assert "devinject: error: " in done.stderr and "nvidia.com/gpu=99" in done.stderr


def test_without_a_server_the_hook_runs_in_process(bundle: Bundle, tmp_path: Path) -> None:
    bundle.use_server(tmp_path / "nobody-listens.sock")
    bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name())
    assert done.returncode == 0 and done.stdout.strip() == "c3:0", done.stderr
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert record["result"] == "ok" and "server" not in record


def _raw_request(path: Path, payload: bytes, *, as_nobody: bool = False) -> bytes:
    """Talk to the server as a client that does not play by the rules: its reply (b"" when it closed the
    connection, unread data making that a reset)."""
    code = ("import array, socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
            "fds = array.array('i', [0, 1, 2]).tobytes()\n"
            "try:\n"
            "    s.sendmsg([bytes.fromhex(sys.argv[2])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])\n"
            "    reply = s.recv(1)\n"
            "except (BrokenPipeError, ConnectionResetError):  # closed on us before or after the request\n"
            "    reply = b''\n"
            "sys.stdout.write(reply.hex())\n")
    command = [sys.executable, "-c", code, str(path), payload.hex()]
    if as_nobody:
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return bytes.fromhex(done.stdout)


def test_the_server_serves_only_its_own_user_and_survives_garbage(bundle: Bundle, server) -> None:  # type: ignore[no-untyped-def]
    from devinject.hook.client import encode_request

    process, path = server
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o666)  # let another user reach it: the server itself must refuse
    dry_run = encode_request(["hook", "--dry-run", "--no-server", "--log-file", "/dev/null"])
    assert _raw_request(path, dry_run, as_nobody=True) == b""  # refused: closed without an answer
    assert _raw_request(path, b"\x00\x00\x00\x09garbage") == b""
    assert _raw_request(path, encode_request(["generate", "--output-dir", "/tmp"])) == b""  # only the hooks
    assert _raw_request(path, encode_request(["cdi-hook", "create-symlinks"])) == b"\x00"  # served: nothing to make
    assert process.poll() is None
    bundle.use_server(path)
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert [r["server"] for r in bundle.log_records() if r.get("stage") == "prestart"] == [process.pid]


def test_the_hook_does_not_use_a_server_run_by_another_user(tmp_path: Path) -> None:
    """A socket that answers as somebody else is not trusted with the request: in-process instead."""
    from devinject.hook.client import run_via_server

    path = Path(f"/tmp/di-other-{os.getpid()}.sock")
    listener = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "import socket, sys, time\ns = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1)\n"
         "print('ready', flush=True)\nc, _ = s.accept(); time.sleep(30)\n", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        assert run_via_server(["hook", "--server", str(path)]) is None
    finally:
        listener.kill()
        listener.wait()
        path.unlink(missing_ok=True)


def test_server_arguments() -> None:
    from devinject.hook.client import DEFAULT_SOCKET, decode_request, encode_request, server_socket

    assert server_socket([]) == DEFAULT_SOCKET
    assert server_socket(["--server", "/x.sock"]) == "/x.sock" and server_socket(["--server=/y"]) == "/y"
    assert server_socket(["--server", "/x.sock", "--no-server"]) is None and server_socket(["--server="]) is None
    assert decode_request(encode_request(["hook", "--spec-dir", "/a b"])) == ["hook", "--spec-dir", "/a b"]
    assert decode_request(b"\x00\x00\x00\x05abc") is None


@pytest.mark.parametrize("served", [True, False], ids=["served", "in-process"])
def test_a_burst_of_container_starts_on_one_rootfs(bundle: Bundle, server, served: bool) -> None:  # type: ignore[no-untyped-def]
    """More containers at once than workers wait: each request gets one (replacements are forked as
    workers take requests). They share one rootfs directory, so their hooks race to make the same mount
    targets: each container still gets its device."""
    process, path = server
    if served:
        bundle.use_server(path)
    bundle.config["hooks"]["prestart"][0]["args"].append("--no-ledger")  # one GPU for all of them
    bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    names = [container_name() for _ in range(8)]
    runs = [subprocess.Popen(["runc", "run", name], cwd=bundle.path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True) for name in names]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0] * 8, outputs
    assert [out.strip() for out, _ in outputs] == ["c3:0"] * 8
    records = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert len(records) == 8 and {r.get("server") for r in records} == {process.pid if served else None}


def test_the_servers_waiting_workers_do_not_outlive_it(server) -> None:  # type: ignore[no-untyped-def]
    import signal

    process, _ = server
    listing = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    for _ in range(200):  # the waiting workers are forked once the socket listens
        children = [int(pid) for pid in listing.read_text().split()]
        if len(children) >= 3:
            break
        time.sleep(0.025)
    assert len(children) >= 3
    process.send_signal(signal.SIGKILL)  # no cleanup of its own
    process.wait()
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in children if Path(f"/proc/{pid}/stat").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert alive == []


def _imports(command: list[str], stdin: str = "") -> set[str]:
    """The modules `command` (a Python run with -X importtime) imported, from its stderr."""
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=60, env={})
    assert done.returncode == 0, done.stderr
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
            and not line.rstrip().endswith("imported package")}


def test_a_served_start_imports_nothing_but_the_client(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The launcher runs on every container start in an interpreter without `site`: what it imports before
    handing over is paid on each one (`os` alone was ~1.4 ms of a ~16 ms budget)."""
    from devinject.install.hooksd import hook_command

    _, path = server
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text('{"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {}}')
    state = f'{{"ociVersion": "1.0.2", "id": "imports", "status": "creating", "pid": 1, "bundle": "{bundle}"}}'
    python, _, isolated, launcher = hook_command()
    bare = _imports([python, isolated, "-X", "importtime", "-c", "pass"])
    served = _imports([python, isolated, "-X", "importtime", launcher, "hook", "--server", str(path),
                       "--log-file", str(tmp_path / "hook.log")], state)
    # (had the server not taken it, the in-process hook's imports would be here too). core/paths.py is the one
    # definition of the socket's default (it was a second literal here); constants that import nothing, it and
    # its package cost ~0.2 ms of module lookups, the price of not keeping a copy in the client.
    assert served - bare == {"devinject", "devinject.entry", "devinject.hook", "devinject.hook.client", "_socket",
                             "devinject.core", "devinject.core.paths"}


def test_install_hook_points_the_hook_at_the_server_and_says_when_none_answers(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from devinject.hook.client import encode_request

    _, path = server
    done = subprocess.run([DEVINJECT, "install-hook", "--hooks-dir", str(tmp_path), "--server", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "no hook server answers" not in done.stderr, done.stderr
    args = json.loads((tmp_path / "10-devinject.json").read_text())["hook"]["args"]
    assert args[-2:] == ["--server", str(path)]
    absent = tmp_path / "absent.sock"
    done = subprocess.run([DEVINJECT, "install-hook", "--runc-snippet", "--server", str(absent)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"note: no hook server answers at {absent}" in done.stderr
    assert json.loads(done.stdout)["hooks"]["prestart"][0]["args"][-2:] == ["--server", str(absent)]
    # the probes were no requests: nothing refused, and the server serves on (a garbage request is refused)
    assert _raw_request(path, b"\x00\x00\x00\x09garbage") == b""
    served = _raw_request(path, encode_request(["hook", "--dry-run", "--no-server", "--log-file", "/dev/null"]))
    assert served == b"\x01"  # served: the hook's own status (no OCI state on its stdin)
    assert (tmp_path / "hook-server.log").read_text().count("refused") == 1


def test_a_replacement_readies_itself_in_the_background_and_then_waits_at_normal_priority(server) -> None:  # type: ignore[no-untyped-def]
    """Forked while other workers wait, a replacement warms up at idle priority (runc's start comes
    first), and must be back at normal priority before it takes a request."""
    from devinject.hook.client import encode_request

    process, path = server
    listing = Path(f"/proc/{process.pid}/task/{process.pid}/children")

    def workers() -> set[int]:
        return {int(pid) for pid in listing.read_text().split()}

    deadline = time.monotonic() + 10
    while len(workers()) < 3 and time.monotonic() < deadline:
        time.sleep(0.025)
    first = workers()
    request = encode_request(["hook", "--dry-run", "--no-server", "--log-file", "/dev/null"])
    assert _raw_request(path, request) == b"\x01"  # served (no OCI state on stdin: the hook's own error)
    ready: dict[int, int] = {}
    while time.monotonic() < deadline:
        fresh = workers() - first
        try:
            ready = {pid: os.sched_getscheduler(pid) for pid in workers()}
        except ProcessLookupError:
            continue  # the worker that served is exiting
        if fresh and len(ready) >= 3 and set(ready.values()) == {os.SCHED_OTHER}:
            break
        time.sleep(0.025)
    assert workers() - first, "no replacement was forked"
    assert set(ready.values()) == {os.SCHED_OTHER}, ready


def test_the_unit_install_hook_writes_starts_a_server_that_serves_the_hook_it_installs(bundle: Bundle,
                                                                                      tmp_path: Path) -> None:
    """`install-hook --server-unit`: the unit's own command line, run as systemd would run it, serves the
    container starts of the hook the same command installs."""
    import shlex

    path = Path(f"/tmp/di-unit-{os.getpid()}-{tmp_path.name[-12:]}") / "hook.sock"
    done = subprocess.run([DEVINJECT, "install-hook", "--runc-snippet", "--server", str(path), "--server-unit",
                           "--unit-dir", str(tmp_path / "units")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    unit = (tmp_path / "units" / "devinject-hook-server.service").read_text()
    exec_start = shlex.split(next(line for line in unit.splitlines() if line.startswith("ExecStart="))[10:])
    with open(tmp_path / "server.log", "w") as errors:
        process = subprocess.Popen(exec_start, stderr=errors, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    try:
        for _ in range(400):
            if path.exists() or process.poll() is not None:
                break
            time.sleep(0.025)
        assert path.exists(), (tmp_path / "server.log").read_text()
        assert json.loads(done.stdout)["hooks"]["prestart"][0]["args"][-2:] == ["--server", str(path)]
        bundle.use_server(path)  # the runc snippet's --server, in the test bundle's hooks
        bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
        ran = bundle.run(container_name())
        assert ran.returncode == 0 and ran.stdout.strip() == "c3:0", ran.stderr
        (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
        assert record["result"] == "ok" and record["server"] == process.pid
    finally:
        process.terminate()
        process.wait(10)
        assert not path.exists()  # stopped as systemd stops it (SIGTERM): the socket is gone
        path.parent.rmdir()


@single_threaded
def test_a_worker_goes_back_from_a_containers_namespace_and_serves_nothing_after_an_import(container: int) -> None:
    """What a served cdi-hook leaves in its worker, undone by `Home.restore`: the container's mount namespace, a
    root and working directory in it, a umask, a descriptor, a stream, an alarm. A module imported meanwhile was
    read in the container's mount namespace: the worker must not go on with it."""
    import importlib
    import signal

    from devinject.hook.server import Home, preload
    from devinject.linux import syscalls

    preload()  # a worker is forked from a server that loaded all a request needs (the C library too)

    def place() -> tuple[object, ...]:
        umask = os.umask(0)
        os.umask(umask)
        return (os.stat("/proc/self/ns/mnt").st_ino, os.stat("/").st_ino, os.getcwd(), umask)

    home = Home()
    before = place()
    stdout = os.fstat(1)
    target = os.open(f"/proc/{container}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    syscalls.setns(target, syscalls.CLONE_NEWNS)  # what a request does in the worker
    os.chroot("/usr")
    os.chdir("/lib")
    os.umask(0o077)
    os.dup2(target, 1)
    signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 30)
    assert os.stat("/").st_ino != before[1] and not os.path.exists("/proc/self")  # elsewhere
    assert home.restore()
    assert place() == before
    with pytest.raises(OSError):
        os.fstat(target)  # the request's own descriptor closed
    assert (os.fstat(1).st_dev, os.fstat(1).st_ino) == (stdout.st_dev, stdout.st_ino)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    importlib.import_module(next(name for name in ("colorsys", "sndhdr", "wave") if name not in sys.modules))
    assert not home.restore()


def test_workers_forked_while_every_worker_is_busy_serve_and_go_once_the_burst_is_over(server) -> None:  # type: ignore[no-untyped-def]
    """Workers serve one request after another, so the server forks more only when none waits: with all of its
    workers held (connections that have not sent their request yet), a request is served by one forked for it,
    and once the held ones are back, the workers forked for the burst exit after RETIRE_AFTER without a request."""
    import socket

    from devinject.hook.client import encode_request
    from devinject.hook.server import RETIRE_AFTER, SPARES

    process, path = server
    listing = Path(f"/proc/{process.pid}/task/{process.pid}/children")

    def workers() -> set[int]:
        return {int(pid) for pid in listing.read_text().split()}

    def until(done: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    until(lambda: len(workers()) >= SPARES, 10)
    first = workers()
    assert len(first) == SPARES
    held = [socket.socket(socket.AF_UNIX) for _ in range(SPARES)]
    try:
        for connection in held:
            connection.connect(str(path))
        until(lambda: len(workers() - first) >= SPARES, 10)
        assert len(workers() - first) == SPARES, "no worker was forked while all were busy"
        assert _raw_request(path, encode_request(["cdi-hook", "create-symlinks"])) == b"\x00"  # served
    finally:
        for connection in held:
            connection.close()  # a connection that sent nothing: a probe, and its worker waits again
    until(lambda: workers() == first, RETIRE_AFTER + 10)
    assert workers() == first
