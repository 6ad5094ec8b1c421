"""containerd 2.3.4 (../shared/peers/containerd2.sh's build) on root configs of version 2, 3 and 4 configured by
`devinject runtime configure`: each starts (a drop-in newer than the root config stops 2.3.0-2.3.4 from starting),
its own `config dump` has CDI on and devinject's spec dir in `plugins.'io.containerd.cri.v1.runtime'` with the
root's other settings kept, and `--revert` gives back the same bytes. On the version 4 config (its own `config
default`, as containerd2.sh adjusts it to its own root and sockets) a CRI pod through crictl asking
`CDI_devices: nvidia.com/gpu=0` of a live fake HGX host (real char nodes) sees exactly that GPU's node. doctor
reads what containerd's own `config dump` merges from a root config and its imports (globs, dot files, relative
and nested imports, versions 2 to 4).

Every daemon runs on its own root, state and sockets under one short temp dir and is stopped at the end of the
module; a missing prerequisite fails in CI, never skips."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.runtimes.config import read_containerd
from devinject.runtimes.daemons import running_containerd
from tests.e2e.conftest import DEVINJECT, require, terminate
from tests.e2e.cri import Crictl, live_hgx_gpu
from tests.e2e.kube import KUBE
from tests.e2e.peers import PEERS
from tests.e2e.peers import unpacked as unpack

pytestmark = pytest.mark.live

SCRIPT = PEERS / "containerd2.sh"
IMAGE = "localhost/busybox:1"  # containerd2.sh's sandbox image


class Containerd2:
    """The unpacked 2.3.4 binaries and a base dir (short: shim sockets) for each daemon of the module."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.bin = base / "bin"
        self.containerd = self.bin / "containerd"
        self.ctr = self.bin / "ctr"

    def dump(self, config: Path) -> str:
        done = subprocess.run([str(self.containerd), "--config", str(config), "config", "dump"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    def start(self, config: Path, socket: Path) -> subprocess.Popen[bytes]:
        log = open(config.parent / "containerd.log", "ab")  # noqa: SIM115 - the daemon's, closed below
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        daemon = subprocess.Popen([str(self.containerd), "--config", str(config)], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while subprocess.run([str(self.ctr), "-a", str(socket), "version"], capture_output=True,
                             timeout=30).returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, \
                (config.parent / "containerd.log").read_text()[-2000:]
            time.sleep(0.2)
        return daemon


@pytest.fixture(scope="module")
def containerd2() -> Iterator[Containerd2]:
    require(os.geteuid() == 0, "needs root")
    require(SCRIPT.exists() and (PEERS / "containerd2.xz").exists(), f"containerd 2.3.4 in {PEERS}")
    require(shutil.which("runc") is not None, "Debian's runc")
    base = Path(tempfile.mkdtemp(prefix="c2-", dir="/tmp"))
    made = Containerd2(base)
    try:
        # the script unpacks the binaries and writes its version 4 config; its daemon is stopped at once
        done = subprocess.run(["bash", str(SCRIPT), "start", str(base / "v4"), str(base / "r4/c.sock"), "/etc/cdi",
                               "/var/run/cdi"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        subprocess.run(["bash", str(SCRIPT), "stop", str(base / "v4")], capture_output=True, timeout=60)
        shutil.copytree(base / "v4/bin", made.bin)
        yield made
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(base / "v4")], capture_output=True, timeout=60)
        mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
        for mount in sorted((m for m in mounts if m.startswith(f"{base}/")), reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def configure(config: Path, *args: str) -> str:
    done = subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "containerd", "--config", str(config),
                           "--runtime-version", "2.3.4", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr + done.stdout


def runtime_section(dump: str) -> str:
    match = re.search(r"^  \[plugins\.'io\.containerd\.cri\.v1\.runtime'\]\n(.*?)\n\n", dump, re.M | re.S)
    assert match, dump[:3000]
    return match.group(1)


def minimal(version: int, base: Path) -> str:
    """A root config of `version` an admin could have kept (a node upgraded from 1.7 keeps its version 2), with
    its own root, state and sockets, NRI off (its socket is the machine's), and a CRI setting of its own."""
    cri = 'plugins."io.containerd.grpc.v1.cri"' if version == 2 else "plugins.'io.containerd.cri.v1.runtime'"
    return (f"version = {version}\nroot = '{base}/root'\nstate = '{base}/state'\n"
            "disabled_plugins = ['io.containerd.nri.v1.nri']\n"
            f"[grpc]\n  address = '{base}/c.sock'\n[ttrpc]\n  address = '{base}/c.sock.ttrpc'\n"
            f"[{cri}]\n  max_container_log_line_size = 12345\n")


@pytest.mark.parametrize("version", [2, 3, 4])
def test_each_root_config_version_starts_configured_and_reverts(containerd2: Containerd2, version: int) -> None:
    base = containerd2.base / f"m{version}"
    base.mkdir()
    config = base / "config.toml"
    if version == 4:  # containerd's own config default, its imports at conf.d beside it as /etc/containerd's are
        text = (containerd2.base / "v4/config.toml").read_text().replace(str(containerd2.base / "r4"), str(base))
        text = re.sub(r"^imports = .*", f"imports = ['{base}/conf.d/*.toml']", text, count=1, flags=re.M)
        text = re.sub(r"^root = .*", f"root = '{base}/root'", text, count=1, flags=re.M)
        text = text.replace("max_container_log_line_size = 16384", "max_container_log_line_size = 12345")
    else:
        text = minimal(version, base)
    config.write_text(text)
    spec_dir = base / "cdi-\U0001f680"  # a name outside the BMP: TOML written by a real encoder
    out = configure(config, "--spec-dir", str(spec_dir), "--spec-dir", "/var/run/cdi")
    assert "wrote" in out and "higher" not in out
    drop_in = base / "conf.d/99-devinject.toml"
    assert drop_in.read_text().count(f"version = {version}\n") == 1
    section = runtime_section(containerd2.dump(config))
    assert "    enable_cdi = true" in section and "max_container_log_line_size = 12345" in section
    assert f"    cdi_spec_dirs = ['{spec_dir}', '/var/run/cdi']" in section, section
    daemon = containerd2.start(config, base / "c.sock")
    try:
        log = (base / "containerd.log").read_text()
        assert "higher than root config version" not in log
    finally:
        terminate(daemon)
    assert "already configured" in configure(config, "--spec-dir", str(spec_dir), "--spec-dir", "/var/run/cdi")
    configure(config, "--revert")
    assert config.read_text() == text and not drop_in.exists()
    assert f"'{spec_dir}'" not in containerd2.dump(config)


def test_a_cri_pod_gets_exactly_its_cdi_gpu(containerd2: Containerd2) -> None:
    base = containerd2.base / "pod"
    base.mkdir()
    run = containerd2.base / "rp"  # state and shim sockets: a short path
    gpu = live_hgx_gpu(base)

    # containerd2.sh's version 4 config, moved to this test's dirs, configured by devinject
    config = base / "config.toml"
    text = (containerd2.base / "v4/config.toml").read_text().replace(str(containerd2.base / "r4"), str(run))
    text = text.replace(str(containerd2.base / "v4"), str(base))
    text = re.sub(r"^imports = .*", f"imports = ['{base}/conf.d/*.toml']", text, count=1, flags=re.M)
    config.write_text(text)
    configure(config, "--spec-dir", str(gpu.spec_dir))
    assert f"cdi_spec_dirs = ['{gpu.spec_dir}']" in runtime_section(containerd2.dump(config))
    socket = run / "c.sock"
    daemon = containerd2.start(config, socket)
    try:
        # doctor on this machine's root reads the config and the version of the containerd that runs
        assert running_containerd(pids=[daemon.pid]) == (daemon.pid, str(config), "2.3.4")
        image = base / "busybox.tar"
        subprocess.run(["python3", str(KUBE / "mkimage.py"), str(image), IMAGE], check=True, capture_output=True,
                       timeout=120)
        subprocess.run([str(containerd2.ctr), "-a", str(socket), "-n", "k8s.io", "images", "import", str(image)],
                       check=True, capture_output=True, timeout=120)
        crictl = Crictl(unpack("crictl", containerd2.bin), socket)
        assert crictl.gpu_seen(base, IMAGE, {"network": 2}) == gpu.seen
    finally:
        terminate(daemon)


CDI_2 = "[plugins.'io.containerd.cri.v1.runtime']"
LAYOUTS: list[dict[str, str]] = [
    # an upgraded node's version 2 file and a version 2 drop-in its glob finds
    {"config.toml": "version = 2\nimports = ['{d}/conf.d/*.toml']\n",
     "conf.d/50.toml": 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  cdi_spec_dirs = ["/v2"]\n'},
    # a `*` never crosses a `/`: the file in the subdirectory is not read, the dot file is
    {"config.toml": "version = 3\nimports = ['{d}/*.toml']\n",
     "sub/a.toml": f"version = 3\n{CDI_2}\n  cdi_spec_dirs = ['/sub']\n",
     ".b.toml": f"version = 3\n{CDI_2}\n  cdi_spec_dirs = ['/dot']\n"},
    # relative imports, in order, the later one winning; a literal import that is not there is no error
    {"config.toml": "version = 3\nimports = ['x/1.toml', 'x/2.toml', '/nonexistent/3.toml']\n",
     "x/1.toml": f"version = 3\n{CDI_2}\n  cdi_spec_dirs = ['/one']\n",
     "x/2.toml": f"version = 3\n{CDI_2}\n  enable_cdi = false\n"},
    # version 4, an import's own import
    {"config.toml": "version = 4\nimports = ['{d}/a.toml']\n", "a.toml": "version = 4\nimports = ['{d}/b.toml']\n",
     "b.toml": f"version = 4\n{CDI_2}\n  cdi_spec_dirs = ['/nested']\n"},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"layout-{i}" for i in range(len(LAYOUTS))])
def test_doctor_reads_what_containerd_itself_merges(containerd2: Containerd2, tmp_path: Path,
                                                    layout: dict[str, str]) -> None:
    """containerd 2.3.4's own merge of a root config and its imports (`config dump`, no daemon) against
    doctor's reading of the same files: CDI on or off, the spec dirs."""
    for path, text in layout.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text.replace("{d}", str(tmp_path)))
    section = runtime_section(containerd2.dump(tmp_path / "config.toml"))
    enabled = "    enable_cdi = true" in section
    dirs = re.search(r"^    cdi_spec_dirs = \[(.*)\]$", section, re.M)
    assert dirs is not None, section
    found = read_containerd(str(tmp_path / "config.toml"))
    assert found.cri(True)[:2] == (enabled, re.findall(r"'([^']*)'", dirs.group(1)))
