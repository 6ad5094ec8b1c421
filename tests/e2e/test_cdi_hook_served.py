"""A spec's `cdi-hook` handed to `devinject hook-server` under real runc and podman (a createContainer hook,
run in the container's mount and pid namespaces): the worker joins the hook's own mount namespace and makes
exactly what the in-process hook makes, confined to the rootfs the same way (the hostile images of
test_hostile_image.py, through the served path); a peer in another user namespace is refused and its hook
runs in-process; a hook with nothing to make is never offered. Each served request is one line of the
server's log (`-v`), so a silent fall back to in-process fails these tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devinject.cdi.spec import load_file
from devinject.linux.ldcache import parse_ldcache
from devinject.specs.generate import hook_command
from tests.e2e import test_hostile_image as hostile_images
from tests.e2e.conftest import PODMAN, Bundle, container_name, in_cdi_dir, terminate
from tests.e2e.test_hostile_image import LIBDIR, hostile, untouched

pytestmark = pytest.mark.live
DEVINJECT = str(Path(sys.executable).parent / "devinject")
SERVED = "cdi-hook served for pid"
canary = hostile_images.canary  # the hostile images' fixtures, shared
hostile_image = hostile_images.hostile_image


class Server:
    def __init__(self, process: subprocess.Popen[str], socket: Path, log: Path) -> None:
        self.process, self.socket, self.log = process, socket, log

    def served(self) -> int:
        return self.log.read_text().count(SERVED)

    def refused(self) -> int:
        return self.log.read_text().count("hook request refused")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    path = Path(f"/tmp/di-cs-{os.getpid()}-{tmp_path.name[-12:]}") / "hook.sock"  # a short socket path
    log = tmp_path / "hook-server.log"
    with open(log, "w") as errors:
        process = subprocess.Popen([DEVINJECT, "-v", "hook-server", "--socket", str(path)], stderr=errors, text=True)
    try:
        for _ in range(400):
            if path.exists() or process.poll() is not None:
                break
            time.sleep(0.025)
        assert path.exists(), log.read_text()
        yield Server(process, path, log)
    finally:
        terminate(process, timeout=10)
        shutil.rmtree(path.parent, ignore_errors=True)


def cdi_container(bundle: Bundle, spec_dir: Path, server: Path | None) -> int:
    """The bundle as a CDI runtime writes it for nvidia.com/gpu=0: the spec's device nodes, its mounts and its
    createContainer hook (no OCI hook), pointed at `server` (else at a socket nobody listens on: in-process);
    how many hooks."""
    spec = load_file(spec_dir / "nvidia.com-gpu.yaml")
    edits = spec.edits.merge(next(d for d in spec.devices if d.name == "0").edits)
    (hook,) = edits.hooks  # the spec's one hook: the libraries' links and cache, the device's own links too
    assert hook.args[hook.args.index("cdi-hook") + 1] == "links-and-ldcache"
    bundle.config["linux"].setdefault("devices", []).extend(
        {"path": n.path, "type": n.type, "major": n.major, "minor": n.minor} for n in edits.device_nodes)
    socket = str(server) if server is not None else str(bundle.path / "nobody-listens.sock")
    bundle.config["hooks"] = {"createContainer": [{"path": hook.path, "args": [*hook.args, "--server", socket],
                                                   "timeout": 30} for hook in edits.hooks]}
    bundle.config["mounts"] += [{"destination": m.container_path, "type": "bind", "source": m.host_path,
                                 "options": ["ro", "nosuid", "nodev", "bind"]} for m in edits.mounts]
    return len(edits.hooks)


def made(rootfs: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The links the hook made in the image's library directory and the cache's entries."""
    libdir = rootfs / LIBDIR
    links = {p.name: os.readlink(p) for p in libdir.iterdir() if p.is_symlink()} if libdir.is_dir() else {}
    cache = [(e.soname, e.path) for e in parse_ldcache((rootfs / "etc" / "ld.so.cache").read_bytes())]
    return links, cache


def test_a_served_cdi_hook_makes_what_the_in_process_one_makes(live_host: Path, spec_dir: Path, tmp_path: Path,
                                                               server: Server) -> None:
    results = {}
    for how in ("in-process", "served"):
        bundle = Bundle(tmp_path / how, spec_dir, tmp_path / f"state-{how}")
        hooks = cdi_container(bundle, spec_dir, server.socket if how == "served" else None)
        bundle.save(["sh", "-c", f"readlink /{LIBDIR}/libcuda.so.1; readlink /dev/dri/by-path/pci-0000:01:00.0-card"])
        before = server.served()
        done = bundle.run(container_name())
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["libcuda.so.550.54.14", "../card1"]  # made over the spec's mounts
        assert server.served() - before == (hooks if how == "served" else 0), server.log.read_text()
        results[how] = made(bundle.rootfs)
    links, cache = results["served"]
    assert links and ("libcuda.so.1", f"/{LIBDIR}/libcuda.so.1") in cache
    assert results["served"] == results["in-process"]


@pytest.mark.parametrize("how", ["served", "in-process"])
@pytest.mark.parametrize("variant", ["plain", "etc"])
def test_a_cdi_hook_writes_the_application_profile_in_root(bundle: Bundle, spec_dir: Path, canary: Path,
                                                           server: Server, variant: str, how: str) -> None:
    """The application profile of the container's GPU, served and in-process: the same file, inside the
    rootfs even when the image's /etc leads to /proc/1/root (the host's root)."""
    from devinject.hook.plan import APPLICATION_PROFILE, application_profile

    if variant == "etc":
        hostile(bundle.rootfs, variant, canary)
    cdi_container(bundle, spec_dir, server.socket if how == "served" else None)
    (hook,) = bundle.config["hooks"]["createContainer"]
    gpu = next(d for d in bundle.config["linux"]["devices"] if d["path"].removeprefix("/dev/nvidia").isdigit())
    hook["args"][-2:-2] = ["--application-profile", gpu["path"]]  # as a spec where the driver ships EGL names it
    bundle.save(["cat", APPLICATION_PROFILE] if variant == "plain" else ["true"])
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert server.served() == (how == "served"), server.log.read_text()
    if variant == "plain":
        assert done.stdout == application_profile((gpu["minor"],)).decode()
    else:
        assert untouched(canary), done.stderr


@pytest.mark.parametrize("variant", ["etc", "libdir"])
def test_a_served_cdi_hook_never_writes_through_proc_1_root(bundle: Bundle, spec_dir: Path, canary: Path,
                                                            server: Server, variant: str) -> None:
    hostile(bundle.rootfs, variant, canary)
    hooks = cdi_container(bundle, spec_dir, server.socket)
    bundle.save(["true"])
    done = bundle.run(container_name())
    assert untouched(canary), done.stderr  # nothing written on the host
    assert done.returncode == 0, done.stderr  # and the container still starts, its edits kept in-root
    assert server.served() == hooks, server.log.read_text()


def test_a_served_cdi_hook_meets_the_links_a_device_plugin_mounted(bundle: Bundle, spec_dir: Path,
                                                                   live_host: Path, server: Server) -> None:
    """`allocate: both`: the device plugin's Allocate answer mounts a SONAME link's target as a file where the
    spec's hook would make the link; the served hook, as the in-process one, finds it there and goes on."""
    hooks = cdi_container(bundle, spec_dir, server.socket)
    real = next(live_host.glob(f"{LIBDIR}/libcuda.so.*.*"))
    bundle.config["mounts"].append({"destination": f"/{LIBDIR}/libcuda.so.1", "type": "bind",
                                    "source": str(real), "options": ["ro", "nosuid", "nodev", "bind"]})
    bundle.save(["sh", "-c", f"test -f /{LIBDIR}/libcuda.so.1 && ! readlink /{LIBDIR}/libcuda.so.1 && "
                             f"readlink /{LIBDIR}/libnvidia-ml.so.1"])
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "libnvidia-ml.so.550.54.14"  # the other links made as before
    assert server.served() == hooks, server.log.read_text()


@pytest.fixture
def served_spec(spec_dir: Path, tmp_path: Path, server: Server) -> Iterator[Path]:
    """The generated nvidia.com/gpu spec, its hooks pointed at the test's server, installed for podman."""
    spec = yaml.safe_load((spec_dir / "nvidia.com-gpu.yaml").read_text())
    hooks = [h for edits in (spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"]))
             for h in edits.get("hooks", [])]
    assert hooks
    for hook in hooks:
        hook["args"] += ["--server", str(server.socket)]
    copy = tmp_path / "served" / "nvidia.com-gpu.yaml"
    copy.parent.mkdir()
    copy.write_text(yaml.safe_dump(spec))
    with in_cdi_dir(copy) as target:
        yield target


@pytest.mark.parametrize("hostile_image", ["etc", "libdir"], indirect=True)
def test_podman_served_cdi_hook_never_writes_through_proc_1_root(hostile_image: str, served_spec: Path,
                                                                 canary: Path, server: Server) -> None:
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=0", hostile_image, "true"],
                          capture_output=True, text=True, timeout=180)
    assert untouched(canary), done.stderr
    assert done.returncode == 0, done.stderr
    assert server.served() == 1, server.log.read_text()  # the spec's one hook, its GPU's /dev/dri links too


def _hook_state(tmp_path: Path) -> tuple[Path, Path]:
    rootfs = tmp_path / "bundle" / "rootfs"
    libdir = rootfs / LIBDIR
    libdir.mkdir(parents=True)
    (rootfs / "etc").mkdir()
    libz = os.path.realpath(f"/{LIBDIR}/libz.so.1")
    shutil.copy(libz, libdir / os.path.basename(libz))
    (rootfs.parent / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                                 "bundle": str(rootfs.parent)}))
    return state, rootfs


def test_a_cdi_hook_in_another_user_namespace_is_refused_and_runs_in_process(tmp_path: Path,
                                                                              server: Server) -> None:
    state, rootfs = _hook_state(tmp_path)
    real = os.path.basename(os.path.realpath(f"/{LIBDIR}/libz.so.1"))
    path, argv, _ = hook_command(None)
    with open(state, "rb") as stdin:  # root mapped to root, in a user namespace of its own
        done = subprocess.run(["unshare", "--user", "--map-root-user", path, *argv[1:], "cdi-hook",
                               "links-and-ldcache", "--link", f"{real}::/{LIBDIR}/libz.so.1", "--folder",
                               f"/{LIBDIR}", "--server", str(server.socket)], stdin=stdin, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (server.served(), server.refused()) == (0, 1), server.log.read_text()
    assert os.readlink(rootfs / LIBDIR / "libz.so.1") == real
    assert ("libz.so.1", f"/{LIBDIR}/libz.so.1") in made(rootfs)[1]


def test_a_cdi_hook_with_nothing_to_make_is_not_offered_to_the_server(server: Server) -> None:
    path, argv, _ = hook_command(None)
    done = subprocess.run([path, *argv[1:], "cdi-hook", "links-and-ldcache", "--server", str(server.socket)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    time.sleep(0.2)
    assert "hook request" not in server.log.read_text() and server.served() == 0


def test_a_peer_inside_a_container_is_refused_and_runs_in_process(tmp_path: Path, server: Server) -> None:
    """A process whose root is not the host's (inside a running container, after pivot_root) that reached the
    socket is no runtime's createContainer hook: refused, before anything is done, and its hook runs here."""
    state, rootfs = _hook_state(tmp_path)
    real = os.path.basename(os.path.realpath(f"/{LIBDIR}/libz.so.1"))
    path, argv, _ = hook_command(None)
    jail = tmp_path / "jail"
    binds = sorted({"/usr", "/lib", "/lib64", "/bin", "/proc", "/tmp", "/dev", str(Path(argv[2]).parents[3])})
    script = f"mount -t tmpfs jail {jail} && " + " && ".join(
        f"mkdir -p {jail}{d} && mount --rbind {d} {jail}{d}" for d in binds if os.path.exists(d))
    command = " ".join([path, *argv[1:], "cdi-hook", "links-and-ldcache", "--link", f"{real}::/{LIBDIR}/libz.so.1",
                        "--folder", f"/{LIBDIR}", "--server", str(server.socket)])
    jail.mkdir()
    with open(state, "rb") as stdin:
        done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               f"{script} && exec chroot {jail} {command}"], stdin=stdin, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (server.served(), server.refused()) == (0, 1), server.log.read_text()
    assert "its root is not the host's" in server.log.read_text()
    assert os.readlink(rootfs / LIBDIR / "libz.so.1") == real  # in-process, in its own root's view


def test_a_server_whose_devinject_was_replaced_refuses_and_exits_for_its_service_to_restart_it(tmp_path: Path) -> None:
    """An upgrade under a running server: the specs the new devinject writes may carry what the old code cannot
    read (this version's `--device-link`), so once its package is replaced every request runs in-process, with
    the new code, and the server exits with status 3 for its service (Restart=on-failure) to start the new one."""
    import devinject

    code = tmp_path / "code"
    shutil.copytree(Path(devinject.__file__).parent, code / "devinject", ignore=shutil.ignore_patterns("__pycache__"))
    socket = Path(f"/tmp/di-cs-{os.getpid()}-replaced") / "hook.sock"
    log = tmp_path / "hook-server.log"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(code)}
    with open(log, "w") as errors:
        process = subprocess.Popen([sys.executable, "-m", "devinject", "-v", "hook-server", "--socket", str(socket)],
                                   stderr=errors, env=env)
    try:
        for _ in range(400):
            if socket.exists() or process.poll() is not None:
                break
            time.sleep(0.025)
        server = Server(process, socket, log)
        state, rootfs = _hook_state(tmp_path)
        real = os.path.basename(os.path.realpath(f"/{LIBDIR}/libz.so.1"))
        path, argv, _ = hook_command(None)

        def cdi_hook() -> subprocess.CompletedProcess[str]:
            with open(state, "rb") as stdin:
                return subprocess.run([path, *argv[1:], "cdi-hook", "create-symlinks", "--link",
                                       f"{real}::/{LIBDIR}/libz.so.1", "--server", str(socket)], stdin=stdin,
                                      capture_output=True, text=True, timeout=60)

        assert cdi_hook().returncode == 0 and (server.served(), server.refused()) == (1, 0), log.read_text()
        init = code / "devinject" / "__init__.py"
        replacement = init.with_name("__init__.py.new")
        replacement.write_bytes(init.read_bytes())
        os.replace(replacement, init)  # as an installer replaces it: a new file
        done = cdi_hook()
        assert done.returncode == 0, done.stderr
        assert os.readlink(rootfs / LIBDIR / "libz.so.1") == real
        assert process.wait(timeout=10) == 3, log.read_text()
        assert server.served() == 1 and not socket.exists()
        text = log.read_text()
        assert "changed on disk" in text and (server.refused() == 1 or "exiting" in text), text
    finally:
        terminate(process, timeout=10)
        shutil.rmtree(socket.parent, ignore_errors=True)


def served_by(server: Server) -> list[int]:
    """The worker that served each cdi-hook, in order (the server's `-v` log)."""
    return [int(worker) for worker in re.findall(rf"{SERVED} \d+ by worker (\d+)", server.log.read_text())]


def _place(pid: int) -> tuple[object, ...]:
    """Process `pid`'s mount namespace, root, working directory and umask."""
    found: list[object] = [(st.st_dev, st.st_ino) for st in (os.stat(f"/proc/{pid}/{what}")
                                                             for what in ("ns/mnt", "root", "cwd"))]
    status = Path(f"/proc/{pid}/status").read_text()
    return (*found, re.search(r"^Umask:\s*(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def workers_back_home(server: Server) -> list[str]:
    """What any of the server's workers kept of the requests it served (its mount namespace, root, working
    directory or umask not the server's), once each has had its time to go back (answered, a worker goes back
    right after): empty when nothing."""
    own = _place(server.process.pid)
    deadline = time.monotonic() + 5
    while True:
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
        kept = []
        for worker in children:
            try:
                place = _place(int(worker))
            except (OSError, AttributeError):
                continue  # gone: exiting after its request
            kept += [f"worker {worker}: {what}" for what, mine, its in
                     zip(("mount namespace", "root", "working directory", "umask"), own, place, strict=True)
                     if mine != its]
        if not kept or time.monotonic() > deadline:
            return kept
        time.sleep(0.05)


def test_a_served_container_leaves_nothing_to_the_next_served_by_the_same_worker(spec_dir: Path, tmp_path: Path,
                                                                                canary: Path, server: Server) -> None:
    """A worker serves one container start after another, joining each one's mount namespace, root and working
    directory: a hostile image's start (its /etc leading to the host's root) is served, and then plain ones
    until the same worker serves one. That one gets its own links and cache, and after each start every worker
    is back in the server's mount namespace, root, working directory and umask."""
    bundle = Bundle(tmp_path / "hostile", spec_dir, tmp_path / "state")
    hostile(bundle.rootfs, "etc", canary)
    cdi_container(bundle, spec_dir, server.socket)
    bundle.save(["true"])
    done = bundle.run(container_name())
    assert done.returncode == 0 and untouched(canary), done.stderr
    assert workers_back_home(server) == []
    (hostile_worker,) = served_by(server)
    for i in range(8):  # the waiting workers take requests in turn: the same one comes round within SPARES
        bundle = Bundle(tmp_path / f"plain-{i}", spec_dir, tmp_path / "state")
        cdi_container(bundle, spec_dir, server.socket)
        bundle.save(["sh", "-c", f"readlink /{LIBDIR}/libcuda.so.1; readlink /dev/dri/by-path/pci-0000:01:00.0-card"])
        done = bundle.run(container_name())
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["libcuda.so.550.54.14", "../card1"]
        assert ("libcuda.so.1", f"/{LIBDIR}/libcuda.so.1") in made(bundle.rootfs)[1]
        assert workers_back_home(server) == []
        if served_by(server)[-1] == hostile_worker:
            break
    assert served_by(server).count(hostile_worker) == 2, server.log.read_text()
    assert untouched(canary)


def test_a_request_from_a_mount_namespace_of_its_own_leaves_the_worker_where_it_was(tmp_path: Path,
                                                                                   server: Server) -> None:
    """The peer's own mount namespace has a tmpfs over the bundle's directory and its working directory in it:
    the served hook makes its links there, and the worker that served it, serving the same path for a peer in
    the host's namespace next, makes them on the host's side (had it stayed in the other namespace, they would
    go to the tmpfs, where nobody sees them)."""
    state, rootfs = _hook_state(tmp_path)
    bundle = rootfs.parent
    real = os.path.basename(os.path.realpath(f"/{LIBDIR}/libz.so.1"))
    path, argv, _ = hook_command(None)
    command = [path, *argv[1:], "cdi-hook", "links-and-ldcache", "--link", f"{real}::/{LIBDIR}/libz.so.1",
               "--folder", f"/{LIBDIR}", "--server", str(server.socket)]
    stash = tmp_path / "stash"
    shutil.copytree(bundle, stash, symlinks=True)
    shutil.rmtree(bundle)
    bundle.mkdir()  # empty on the host; the peer's own namespace has the bundle there, on a tmpfs
    script = (f"mount -t tmpfs elsewhere {bundle} && cp -a {stash}/. {bundle}/ && cd {rootfs} && umask 077 && "
              f"exec {' '.join(command)}")
    with open(state, "rb") as stdin:
        done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], stdin=stdin,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert list(bundle.iterdir()) == []  # made in the peer's namespace only
    assert workers_back_home(server) == []
    (elsewhere_worker,) = served_by(server)
    shutil.copytree(stash, bundle, dirs_exist_ok=True, symlinks=True)
    for _ in range(8):
        (rootfs / LIBDIR / "libz.so.1").unlink(missing_ok=True)
        with open(state, "rb") as stdin:
            done = subprocess.run(command, stdin=stdin, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert os.readlink(rootfs / LIBDIR / "libz.so.1") == real  # on the host's side
        assert workers_back_home(server) == []
        if served_by(server)[-1] == elsewhere_worker:
            break
    assert served_by(server).count(elsewhere_worker) == 2, server.log.read_text()


def test_a_worker_whose_request_failed_exits_and_is_replaced(tmp_path: Path, server: Server) -> None:
    """A cdi-hook that failed may have stopped anywhere (an error, its deadline): the worker that served it
    serves nothing more, and the server forks another."""
    path, argv, _ = hook_command(None)
    done = subprocess.run([path, *argv[1:], "cdi-hook", "create-symlinks", "--link", "bad", "--server",
                           str(server.socket)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "devinject: error:" in done.stderr, done.stderr
    (worker,) = served_by(server)
    deadline = time.monotonic() + 10
    children: list[str] = []
    while time.monotonic() < deadline:
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
        if str(worker) not in children and len(children) >= 3:
            break
        time.sleep(0.05)
    assert str(worker) not in children and len(children) >= 3, children


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full: a write to it blocks until its reader reads (a hook's stderr nobody drains)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"x" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(write_end, True)  # the hook's writes block, up to the worker's 30 s deadline
    return read_end, write_end


@contextlib.contextmanager
def every_worker_held(server: Server) -> Iterator[list[subprocess.Popen[bytes]]]:
    """MAX_WORKERS cdi-hooks, each holding a worker (a slow hook: here, its error written to a stderr that is
    not read, for up to the worker's 30 s deadline; a hostile image's huge library folder holds one as long),
    all of them taken once this yields; let go of after."""
    from devinject.hook.server import MAX_WORKERS

    path, argv, _ = hook_command(None)
    held: list[subprocess.Popen[bytes]] = []
    pipes = [_full_pipe() for _ in range(MAX_WORKERS)]
    try:
        for _, stderr in pipes:
            held.append(subprocess.Popen([path, *argv[1:], "cdi-hook", "create-symlinks", "--link", "bad",
                                          "--server", str(server.socket)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=stderr))
        deadline = time.monotonic() + 60
        while server.served() < MAX_WORKERS and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.served() == MAX_WORKERS, server.log.read_text()
        yield held
    finally:
        for read_end, write_end in pipes:
            os.close(write_end)
            os.set_blocking(read_end, False)
            try:
                while os.read(read_end, 65536):  # the workers' writes go through: they answer and exit
                    pass
            except BlockingIOError:
                pass
        for process in held:
            terminate(process, timeout=10)
        for read_end, _ in pipes:
            os.close(read_end)


def test_requests_beyond_the_busy_workers_run_in_process_rather_than_wait(spec_dir: Path, tmp_path: Path,
                                                                        server: Server) -> None:
    """MAX_WORKERS slow cdi-hooks hold every worker: the next container's start under runc, another tenant's,
    must not wait for one of them in the socket's backlog (up to the client's 60 s, past a runtime's hook
    timeout: here runc's 30 s). Its hook runs in-process at once, while all of them still hold."""
    from devinject.hook.server import MAX_WORKERS

    with every_worker_held(server) as held:
        bundle = Bundle(tmp_path / "tenant", spec_dir, tmp_path / "state")
        cdi_container(bundle, spec_dir, server.socket)
        bundle.save(["sh", "-c", f"readlink /{LIBDIR}/libcuda.so.1; readlink /dev/dri/by-path/pci-0000:01:00.0-card"])
        done = bundle.run(container_name(), timeout=25)  # the held ones hold ~30 s
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["libcuda.so.550.54.14", "../card1"]
        assert [p.pid for p in held if p.poll() is not None] == []  # not answered by a worker one of them freed
        assert server.served() == MAX_WORKERS and f"all {MAX_WORKERS} hook workers busy" in server.log.read_text()


def _wake_ups(pid: int) -> int:
    """How many times process `pid` has gone to sleep and woken (its voluntary context switches)."""
    found = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert found is not None
    return int(found.group(1))


def test_a_server_whose_workers_are_all_busy_waits_rather_than_spins(server: Server) -> None:
    """While slow hooks hold every worker the server can fork no other: its loop waits for a worker to come
    back (or a request to refuse) rather than waking every millisecond to find it still cannot, burning CPU
    that the container starts it waits on need."""
    with every_worker_held(server):
        before = _wake_ups(server.process.pid)
        time.sleep(2)
        woken = _wake_ups(server.process.pid) - before
    assert woken < 100, woken  # its 0.5 s wait: a handful; waking every 1 ms: ~2000
