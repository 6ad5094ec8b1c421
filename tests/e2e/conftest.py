"""Live tests: real runc and podman, as root, against fake hosts with mknod-made nodes and real ELF
libraries. In CI (CI=true) a missing runtime is a failure, never a silent skip."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devinject.cdi.model import ContainerEdits
from devinject.install.hooksd import hook_command, runc_hooks
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_workstation

REPO = Path(__file__).resolve().parents[2]
DEVINJECT = str(Path(sys.executable).parent / "devinject")
BUSYBOX_APPLETS = ("sh", "cat", "ls", "stat", "mknod", "grep", "head", "readlink", "echo", "sleep", "test", "wc",
                   "true")
IMAGE = "localhost/devinject-busybox:test"


def require(condition: bool, reason: str) -> None:
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"live test prerequisite missing in CI: {reason}")
    pytest.skip(f"LIVE TEST SKIPPED: {reason}")


def in_private_mount_ns(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -c code args` in a private mount namespace of its own (`unshare -m`), so whatever it mounts
    goes away with it; devinject imported from this checkout."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code, *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="session")
def live_root() -> None:
    require(os.geteuid() == 0, "needs root (mknod, mount, runc)")
    for tool in ("runc", "busybox", "ldconfig", "gcc"):
        require(shutil.which(tool) is not None, f"{tool} not installed (make system-deps)")


@pytest.fixture(scope="session")
def live_host(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workstation host (RTX 4090, iGPU, vfio, ConnectX) with real char nodes."""
    root = tmp_path_factory.mktemp("live") / "host"
    builder = LibBuilder()
    try:
        build_workstation(builder, FakeHost(root, real_nodes=True))
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    return root


@pytest.fixture(scope="session")
def spec_dir(live_host: Path) -> Path:
    out = live_host.parent / "cdi"
    subprocess.run([DEVINJECT, "generate", "--root", str(live_host), "--output-dir", str(out),
                    "--hook-path", DEVINJECT], check=True, capture_output=True)
    return out


def make_rootfs(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", path / "bin" / "busybox")
    for applet in BUSYBOX_APPLETS:
        (path / "bin" / applet).symlink_to("busybox")
    for directory in ("proc", "sys", "dev", "tmp", "etc"):
        (path / directory).mkdir(exist_ok=True)
    return path


def oci_edits(edits: ContainerEdits) -> dict[str, object]:
    """The CDI edits as a runtime writes them into config.json (mounts, nodes and their cgroup rules, hooks)."""
    mounts = [{"destination": m.container_path, "type": "bind", "source": m.host_path,
               "options": list(m.options) or ["ro", "nosuid", "nodev", "bind"]} for m in edits.mounts]
    devices, rules = [], []
    for node in edits.device_nodes:
        st = os.stat(node.host_path or node.path)
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        devices.append({"path": node.path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666,
                        "uid": 0, "gid": 0})
        rules.append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
    hooks = [{"path": h.path, "args": list(h.args), "env": list(h.env), "timeout": h.timeout or 10}
             for h in edits.hooks]
    return {"mounts": mounts, "devices": devices, "rules": rules, "hooks": hooks}


class Bundle:
    def __init__(self, path: Path, spec_dir: Path, state_dir: Path) -> None:
        self.path = path
        self.rootfs = make_rootfs(path / "rootfs")
        self.spec_dir = spec_dir
        self.state_dir = state_dir
        self.log = path / "hook.log"
        subprocess.run(["runc", "spec"], cwd=path, check=True)
        self.config = json.loads((path / "config.json").read_text())
        self.config["process"]["terminal"] = False
        self.config["root"]["readonly"] = False
        for key in ("bounding", "effective", "permitted"):
            self.config["process"]["capabilities"][key].append("CAP_MKNOD")
        # as `install-hook --poststop` writes it: the launcher, in both stages
        self.config["hooks"] = runc_hooks(hook_command(), poststop=True)["hooks"]
        for hook in self.config["hooks"]["prestart"] + self.config["hooks"]["poststop"]:
            hook["args"] += ["--spec-dir", str(spec_dir), "--state-dir", str(state_dir), "--log-file", str(self.log),
                             "--no-server"]  # in-process, whatever runs on this machine; test_hook_server.py opts in

    def use_server(self, socket: Path) -> None:
        for hook in self.config["hooks"]["prestart"] + self.config["hooks"].get("poststop", []):
            hook["args"] = [arg for arg in hook["args"] if arg != "--no-server"] + ["--server", str(socket)]

    def without_poststop(self) -> None:
        """As `install-hook` writes it by default: the ledger frees a dead container's devices by itself."""
        self.config["hooks"].pop("poststop", None)

    def use_spec_dir(self, spec_dir: Path) -> None:
        for hook in self.config["hooks"]["prestart"] + self.config["hooks"].get("poststop", []):
            args = hook["args"]
            args[args.index("--spec-dir") + 1] = str(spec_dir)

    def save(self, args: list[str], *, annotations: dict[str, str] | None = None, env: list[str] | None = None) -> None:
        self.config["process"]["args"] = args
        self.config["annotations"] = annotations or {}
        self.config["process"]["env"] = ["PATH=/bin", *(env or [])]
        (self.path / "config.json").write_text(json.dumps(self.config, indent=1))

    def run(self, name: str, *, v2: bool = False, detach: bool = False, timeout: int = 60) \
            -> subprocess.CompletedProcess[str]:
        command = ["runc", "run", *(["--detach"] if detach else []), name]
        if v2:  # runc uses cgroup v2 (eBPF device filter) when /sys/fs/cgroup is cgroup2
            script = ("mount --make-rprivate / && mount -t cgroup2 none /sys/fs/cgroup && exec "
                      + " ".join(command))
            command = ["unshare", "-m", "sh", "-c", script]
        return subprocess.run(command, cwd=self.path, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def log_records(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def bundle(live_host: Path, spec_dir: Path, tmp_path: Path) -> Iterator[Bundle]:
    made = Bundle(tmp_path / "bundle", spec_dir, tmp_path / "state")
    yield made
    for line in subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout.split():
        if line.startswith("di-"):
            subprocess.run(["runc", "delete", "-f", line], capture_output=True)


def terminate(process: subprocess.Popen[Any], timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL once `timeout` passes: a test never leaves its process behind."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def container_name() -> str:
    return f"di-{uuid.uuid4().hex[:10]}"


PODMAN = ["podman", "run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
          "nproc=1024:1024", "--network", "none"]
CDI_DIR = Path("/var/run/cdi")


@pytest.fixture(scope="session")
def image(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    require(shutil.which("podman") is not None, "podman not installed (make system-deps)")
    rootfs = make_rootfs(tmp_path_factory.mktemp("image") / "rootfs")
    tarball = rootfs.parent / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    subprocess.run(["podman", "import", "-q", str(tarball), IMAGE], check=True, capture_output=True)
    return IMAGE


@contextlib.contextmanager
def in_cdi_dir(spec: Path) -> Iterator[Path]:
    """Put a spec file where podman 4 looks (it has no spec-dir flag); what was there comes back after."""
    CDI_DIR.mkdir(parents=True, exist_ok=True)
    target = CDI_DIR / spec.name
    backup = target.read_bytes() if target.exists() else None
    shutil.copy(spec, target)
    try:
        yield target
    finally:
        if backup is None:
            target.unlink()
        else:
            target.write_bytes(backup)


@pytest.fixture
def cdi_spec(spec_dir: Path) -> Iterator[Path]:
    """The generated nvidia.com/gpu spec, installed for podman."""
    with in_cdi_dir(spec_dir / "nvidia.com-gpu.yaml") as target:
        yield target


@contextlib.contextmanager
def stand_ins(count: int, *command: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes standing in for containers (a hook needs a live pid), killed and reaped however the test
    ends. Default: `sleep 120`."""
    processes = [subprocess.Popen(list(command) or ["sleep", "120"]) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


# A node that no container's device cgroup names by default (runc's, containerd's and podman's defaults list
# /dev/null, zero, full, random, urandom, tty, console, ptmx and tun by name): a ledger rebuild on this machine
# finds it granted only where a test grants it, whatever containers run beside the tests.
UNLISTED_NODE = "/dev/fuse"
# A char major for the devices a unit test books and then rebuilds its ledger over from live evidence: no
# fixture host hands it out (240-254 are the kernel's local-use majors; the fixtures' dynamic ones are
# others), so the rebuild never finds a live cluster's pod holding it, as it finds the fake GPUs (c 195:N)
UNBOOKED_MAJOR = 250


_HOLDER = ("import os, sys\n"
           "sys.stdin.readline()  # placed in its cgroup first: a device cgroup checks the open\n"
           "held = os.open(sys.argv[1], int(sys.argv[2]))\n"
           "print('held', flush=True)\n"
           "sys.stdin.readline()\n")


@contextlib.contextmanager
def node_holder(path: str, *, cgroup_grants: bool, flags: int = os.O_RDONLY,
                uid: int | None = None) -> Iterator[int]:
    """A process in a mount namespace of its own holding `path` open (with `flags`); its pid. With
    `cgroup_grants`, it runs in a v1 device cgroup of its own that denies everything but `path`'s node, by
    name — as a runtime sets up a container. Without it, it stays in this test's cgroup: anyone's
    `unshare`. `uid`: as that user (and group), in a user namespace of its own (`unshare -Urm`). Needs
    root."""
    import uuid

    require(os.geteuid() == 0, "needs root (namespaces, cgroups)")
    command = ["unshare", "-m", "--propagation", "private", sys.executable, "-c", _HOLDER, path, str(flags)]
    if uid is not None:
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "unshare", "-Urm",
                   sys.executable, "-c", _HOLDER, path, str(flags)]
    group = None
    if cgroup_grants:
        devices = Path("/sys/fs/cgroup/devices")
        require((devices / "devices.allow").exists(), "needs the cgroup v1 devices controller")
        group = devices / f"devinject-test-{uuid.uuid4().hex[:8]}"
        group.mkdir()
    holder = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdin is not None and holder.stdout is not None
        if group is not None:
            st = os.stat(path)
            (group / "cgroup.procs").write_text(str(holder.pid))
            (group / "devices.deny").write_text("a")
            (group / "devices.allow").write_text(f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rw")
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        if group is not None:
            for _ in range(100):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


@contextlib.contextmanager
def pid_namespace_init() -> Iterator[int]:
    """A `sleep` that is pid 1 of a pid namespace of its own, as a container's init is; its pid here. Its
    `unshare` parent is killed and reaped however the test ends. Needs root."""
    require(os.geteuid() == 0, "needs root (a pid namespace)")
    unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "60"])
    try:
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
        for _ in range(200):
            if children.read_text().split():
                break
            time.sleep(0.01)
        yield int(children.read_text().split()[0])
    finally:
        unshare.kill()
        unshare.wait()


@contextlib.contextmanager
def world_reachable_node(rdev: int) -> Iterator[str]:
    """A char node with device number `rdev` where an unprivileged user reaches it (pytest's temporary
    directories are root's alone); its path. Removed afterwards."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="devinject-node-")
    os.chmod(directory, 0o755)
    node = os.path.join(directory, "node")
    os.mknod(node, 0o666 | 0o020000, rdev)
    try:
        yield node
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def held_in_a_container(path: str) -> Iterator[int]:
    """`path` held open by a container's process: a mount namespace of its own, and a device cgroup that
    grants the node by name. Its pid. Needs root and the v1 devices controller."""
    with node_holder(path, cgroup_grants=True) as pid:
        yield pid


def write_spec_dir(directory: Path, name: str, text: str) -> Path:
    """A CDI spec dir holding one spec file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory
