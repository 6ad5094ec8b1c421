"""Real docker (dockerd 29.7.2 + runc 1.5.1 from ../shared/peers, started by its docker.sh in a private mount
namespace on its own data root and socket): `devinject runtime configure --runtime docker` makes `docker run
--device nvidia.com/gpu=0` give the container exactly that GPU's node from a spec of a live fake HGX host;
`--revert` gives back the same bytes and a dockerd that starts; with `--cdi-spec-dir` on dockerd's command line
configure writes nothing (dockerd would refuse to start: its own `--validate` shows it) and doctor's fix, the
flag, works; every daemon.json configure writes passes dockerd's own `--validate`. One dockerd for the module,
restarted where a test changes its configuration; nothing left running."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devinject.runtimes import docker
from tests.e2e.conftest import DEVINJECT, require
from tests.e2e.peers import PEERS
from tests.integration.test_doctor import Live

pytestmark = pytest.mark.live

KUBE = PEERS.parent / "kube"
IMAGE = "devinject-busybox:docker"
GPU = "nvidia.com/gpu=0"


def unpack(name: str, target: Path) -> Path:
    """A peer binary unpacked and checked against SHA256SUMS."""
    sums = dict(reversed(line.split()) for line in (PEERS / "SHA256SUMS").read_text().splitlines() if line.strip())
    data = lzma.decompress((PEERS / f"{name}.xz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == sums[name], f"{name}: not the binary SHA256SUMS names"
    target.write_bytes(data)
    target.chmod(0o755)
    return target


class Dockerd:
    """One standalone dockerd (docker.sh), its config file, the docker CLI on its socket."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.run_dir = Path(f"/run/di-{uuid.uuid4().hex[:8]}")
        self.config = base / "daemon.json"
        self.bin = base / "bin"
        self.bin.mkdir()
        self.dockerd = unpack("dockerd", self.bin / "dockerd")
        unpack("runc-1.5.1", self.bin / "runc")
        self.config.write_text(json.dumps({"runtimes": {"runc-1.5": {"path": str(self.bin / "runc")}},
                                           "default-runtime": "runc-1.5"}, indent=2) + "\n")
        self.cli = ["docker", "-H", f"unix://{self.run_dir}/docker.sock"]
        self.flags: list[str] = []

    def _script(self, verb: str) -> subprocess.CompletedProcess[str]:
        launcher = self.dockerd
        if self.flags:  # extra flags on dockerd's command line, as a unit's ExecStart would add them
            launcher = self.base / "dockerd-with-flags"
            launcher.write_text(f"#!/bin/sh\nexec {self.dockerd} {' '.join(self.flags)} \"$@\"\n")
            launcher.chmod(0o755)
        env = {**os.environ, "BASE": str(self.base), "RUN": str(self.run_dir), "DOCKERD": str(launcher),
               "CONFIG": str(self.config)}
        return subprocess.run(["bash", str(PEERS / "docker.sh"), verb], capture_output=True, text=True, env=env,
                              timeout=120)

    def start(self) -> None:
        done = self._script("start")
        assert done.returncode == 0, done.stdout + done.stderr

    def stop(self) -> None:
        done = self._script("stop")
        assert done.returncode == 0, done.stdout + done.stderr

    def restart(self, *flags: str) -> None:
        self.stop()
        self.flags = list(flags)
        self.start()

    def spec_dirs(self) -> list[str]:
        done = subprocess.run([*self.cli, "info", "--format", "{{json .CDISpecDirs}}"], capture_output=True,
                              text=True, timeout=60, check=True)
        return list(json.loads(done.stdout))

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.cli, "run", "--rm", "--network", "none", *args], capture_output=True,
                              text=True, timeout=120)

    def validate(self, config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
        """dockerd's own check of a config file with these flags (as the started one runs: no userland proxy)."""
        return subprocess.run([str(self.dockerd), "--validate", "--userland-proxy=false", "--config-file",
                               str(config), *flags], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Dockerd, Path, Path]]:
    """The started dockerd with the image loaded, and a live fake HGX host's spec dir (not docker's)."""
    require(os.geteuid() == 0, "needs root (mknod, namespaces, dockerd)")
    require(shutil.which("docker") is not None, "the docker CLI is not installed (make system-deps)")
    require((PEERS / "dockerd.xz").exists(), f"{PEERS}/dockerd.xz missing")
    base = Path(tempfile.mkdtemp(prefix="dkr", dir="/tmp"))
    daemon = Dockerd(base)
    try:
        host = Live(base / "node")  # the HGX H100 fixture, its nodes real, its specs generated
        cdi = host.cdi
        daemon.start()
        subprocess.run(["python3", str(KUBE / "mkimage.py"), str(base / "image.tar"), IMAGE], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([*daemon.cli, "load", "-i", str(base / "image.tar")], check=True, capture_output=True,
                       timeout=120)
        yield daemon, cdi, host.root
    finally:
        daemon._script("stop")
        shutil.rmtree(daemon.run_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def configure(daemon: Dockerd, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "docker", "--config", str(daemon.config),
                           *args], capture_output=True, text=True, timeout=60)


def gpu_node(cdi: Path, name: str) -> str:
    spec = yaml.safe_load((cdi / "nvidia.com-gpu.yaml").read_text())
    (device,) = [d for d in spec["devices"] if d["name"] == name]
    (node,) = device["containerEdits"]["deviceNodes"]
    return str(node["path"])


LIST_GPUS = "ls /dev | grep -E '^nvidia[0-9]+$'; echo done"


def test_configure_then_docker_run_gets_exactly_its_gpu_and_revert_gives_the_bytes_back(node):
    daemon, cdi, _ = node
    before = daemon.config.read_bytes()
    assert daemon.spec_dirs() == ["/etc/cdi", "/var/run/cdi"]
    assert daemon.run("--device", GPU, IMAGE, "true").returncode != 0  # its spec dir is not docker's

    done = configure(daemon, "--spec-dir", str(cdi))  # no --runtime-version: the running dockerd is asked
    assert done.returncode == 0 and f"wrote {daemon.config}" in done.stderr + done.stdout, done.stderr
    assert json.loads(daemon.config.read_text())["cdi-spec-dirs"] == ["/etc/cdi", "/var/run/cdi", str(cdi)]
    assert "features" not in json.loads(daemon.config.read_text())  # 29.7: CDI is on by default
    daemon.restart()
    assert daemon.spec_dirs() == ["/etc/cdi", "/var/run/cdi", str(cdi)]
    status = docker.node_status("/", version=None, hook_installed=False, config=str(daemon.config))
    assert status.applies and str(cdi) in (status.spec_dirs or ()) and "docker 29.7.2" in status.detail

    ran = daemon.run("--device", GPU, IMAGE, "sh", "-c", LIST_GPUS)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == [gpu_node(cdi, "0").removeprefix("/dev/"), "done"]

    again = configure(daemon, "--spec-dir", str(cdi))
    assert again.returncode == 0 and "already configured" in again.stderr + again.stdout
    reverted = configure(daemon, "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert daemon.config.read_bytes() == before and not Path(f"{daemon.config}.devinject").exists()
    daemon.restart()
    assert daemon.spec_dirs() == ["/etc/cdi", "/var/run/cdi"]


def test_a_spec_dir_flag_on_dockerd_is_never_clashed_with_and_doctors_fix_works(node):
    daemon, cdi, _ = node
    other = daemon.base / "other-cdi"
    other.mkdir(exist_ok=True)
    before = daemon.config.read_bytes()
    daemon.restart("--cdi-spec-dir", str(other))
    try:
        assert daemon.spec_dirs() == [str(other)]
        done = configure(daemon, "--spec-dir", str(cdi))
        out = done.stderr + done.stdout
        assert done.returncode == 1 and len(out.splitlines()) == 1, out
        assert f"add --cdi-spec-dir {cdi} there" in out
        assert daemon.config.read_bytes() == before and not Path(f"{daemon.config}.devinject").exists()
        # what writing the key would have done: dockerd itself refuses the pair
        clash = daemon.base / "clash.json"
        clash.write_text(json.dumps({**json.loads(before), "cdi-spec-dirs": [str(cdi)]}))
        refused = daemon.validate(clash, "--cdi-spec-dir", str(other))
        assert refused.returncode != 0 and "specified both as a flag and in the configuration file" in refused.stderr

        status = docker.node_status("/", version=None, hook_installed=False, config=str(daemon.config))
        assert status.applies and status.spec_dirs == (str(other),) and status.spec_dir_fix
        assert status.spec_dir_fix.startswith("add --cdi-spec-dir {spec_dir} to dockerd's command line")
        daemon.restart("--cdi-spec-dir", str(other), "--cdi-spec-dir", str(cdi))  # the fix, applied
        fixed = docker.node_status("/", version=None, hook_installed=False, config=str(daemon.config))
        assert fixed.spec_dirs == (str(other), str(cdi))
        ran = daemon.run("--device", GPU, IMAGE, "sh", "-c", LIST_GPUS)
        assert ran.returncode == 0 and ran.stdout.split() == [gpu_node(cdi, "0").removeprefix("/dev/"), "done"]
    finally:
        daemon.restart()


def test_an_admins_cdi_false_is_named_by_doctor_and_its_fix_starts_dockerd_with_cdi(node):
    daemon = node[0]
    before = daemon.config.read_bytes()
    try:
        daemon.config.write_text(json.dumps({**json.loads(before), "features": {"cdi": False}}))
        daemon.restart()
        assert daemon.spec_dirs() == []  # dockerd 29.7.2 with CDI off reads no spec dir
        done = configure(daemon)
        assert done.returncode == 1 and "features.cdi is false" in done.stderr  # configure leaves it be
        status = docker.node_status("/", version=None, hook_installed=False, config=str(daemon.config))
        assert not status.applies and status.fix and status.fix.startswith("set features.cdi to true in")
        daemon.config.write_text(json.dumps({**json.loads(before), "features": {"cdi": True}}))  # the fix
        daemon.restart()
        assert daemon.spec_dirs() == ["/etc/cdi", "/var/run/cdi"]
        assert docker.node_status("/", version=None, hook_installed=False, config=str(daemon.config)).applies
    finally:
        daemon.config.write_bytes(before)
        daemon.restart()


def test_a_daemon_json_the_running_dockerd_would_refuse_is_refused_in_its_words(node):
    """An unknown key (an admin's typo): dockerd refuses to start on it, and devinject, which keeps no list of
    dockerd's keys, asks the running dockerd itself (--validate with its own flags)."""
    daemon, cdi, _ = node
    before = daemon.config.read_bytes()
    try:
        daemon.config.write_text(json.dumps({**json.loads(before), "log-drivr": "journald"}))
        typo = daemon.config.read_bytes()
        done = configure(daemon, "--spec-dir", str(cdi))
        out = done.stderr + done.stdout
        assert done.returncode == 1 and len(out.splitlines()) == 1, out
        assert f"{daemon.config}: dockerd refuses it" in out and "log-drivr" in out
        assert daemon.config.read_bytes() == typo and not Path(f"{daemon.config}.devinject").exists()
    finally:
        daemon.config.write_bytes(before)


ADMIN_FILES = {
    "absent": None,
    "bom-crlf": '\ufeff{\r\n  "debug": true\r\n}\r\n',
    "vendor-dirs": '{"cdi-spec-dirs": ["/opt/vendor/cdi"], "features": {"containerd-snapshotter": false}}',
    "empty": "",
}


@pytest.mark.parametrize("version", ["25.0", "28.1", "29.7.2"])
@pytest.mark.parametrize("admin", sorted(ADMIN_FILES))
def test_what_configure_writes_dockerd_accepts_and_revert_is_exact(node, tmp_path: Path, admin: str, version: str):
    daemon = node[0]
    config = tmp_path / "daemon.json"
    text = ADMIN_FILES[admin]
    if text is not None:
        config.write_bytes(text.encode())
        assert daemon.validate(config).returncode == 0  # dockerd takes the admin's file as it is
    done = subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "docker", "--config", str(config),
                           "--runtime-version", version, "--spec-dir", "/opt/devinject/cdi"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    checked = daemon.validate(config)
    assert checked.returncode == 0, (config.read_text(), checked.stderr)
    written = json.loads(config.read_text().removeprefix("\ufeff"))
    assert ("cdi" in written.get("features", {})) == (version != "29.7.2")
    assert written["cdi-spec-dirs"][-1] == "/opt/devinject/cdi"
    subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "docker", "--config", str(config), "--revert"],
                   check=True, capture_output=True, timeout=60)
    assert (config.read_bytes() if config.exists() else None) == (text.encode() if text is not None else None)


STAND_INS = {
    # any user can name a process dockerd
    "another-user": ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
    # so can a container's image (docker-in-docker): a root process in a pid namespace of its own
    "a-container": ["unshare", "--pid", "--fork", "--kill-child"],
}


@pytest.mark.parametrize("who", sorted(STAND_INS))
def test_a_process_named_dockerd_that_is_not_the_nodes_is_not_asked_anything(who: str):
    """The attack: a process whose argv[0] is `dockerd` and whose --config-file is the one being configured (the
    host's default path, for a container's), its binary python with `-c` code that writes a marker when run as
    root with --version or --validate. devinject, as root, must neither run its binary (to ask a version, or to
    --validate) nor take its flags."""
    require(os.geteuid() == 0 and shutil.which(STAND_INS[who][0]) is not None, f"needs root and {STAND_INS[who][0]}")
    require(os.access("/usr/bin/python3", os.X_OK), "needs /usr/bin/python3 (the stand-in's binary)")
    workdir = Path(tempfile.mkdtemp(prefix="dkr-evil-", dir="/tmp"))
    workdir.chmod(0o755)  # the user nobody reaches its config file
    config = workdir / "daemon.json"
    config.write_text("{}")
    marker = workdir / "ran-as-root"
    code = (f"import os, sys, time\nif os.getuid() == 0 and ('--version' in sys.argv or '--validate' in sys.argv):"
            f" open({str(marker)!r}, 'w').write('x'); sys.exit(0)\ntime.sleep(60)\n")
    fake = subprocess.Popen([*STAND_INS[who], "bash", "-c", 'exec -a dockerd "$0" -c "$1" --config-file "$2"',
                             "/usr/bin/python3", code, str(config)])

    def named_dockerd() -> bool:
        pids = [str(fake.pid), *Path(f"/proc/{fake.pid}/task/{fake.pid}/children").read_text().split()]
        return any(Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"dockerd\0") for pid in pids)
    try:
        for _ in range(200):  # its command line in place
            if named_dockerd():
                break
            time.sleep(0.05)
        assert named_dockerd()
        for args in ((), ("--runtime-version", "27.0")):
            subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "docker", "--config", str(config), *args],
                           capture_output=True, text=True, timeout=60)
        assert not marker.exists()  # its binary never ran as root
        assert docker.find_daemon("/", str(config)).pid is None  # nor are its flags taken as dockerd's
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(workdir, ignore_errors=True)
