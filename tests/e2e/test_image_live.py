"""The agent's image, built here from the project alone (`make image`: Debian's packages through mmdebstrap,
no registry), imported into a containerd of its own (own root, state and sockets under a temp dir, never the
cluster's) and run there with `ctr run` against the HGX fixture host. A missing prerequisite fails the test:
it never skips."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from tools.mkimage import IMPORT_ALL  # every devinject module, the way the build checks the image

from tests.e2e.conftest import DEVINJECT, REPO

pytestmark = pytest.mark.live

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
NAME = f"localhost/devinject:{VERSION}"
ARCHIVE = REPO / "build" / "devinject-image.tar"
FIXTURE = REPO / "tests" / "fixtures" / "hosts" / "hgx-h100"
NAMESPACE = "devinject-image-test"
MIB = 1 << 20
UNPACKED_MAX_MIB = 110  # 91 MiB when written, 101 MiB with journalctl; a hand-built image was 264 MiB


def need(condition: bool, reason: str) -> None:
    if not condition:
        pytest.fail(f"image test prerequisite missing: {reason}")


def make_image(output: Path | None = None, epoch: int | None = None,
               source: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = ["make", "-s", "image"] if output is None else [
        sys.executable, str(REPO / "tools" / "mkimage.py"), "--output", str(output),
        *(["--source", str(source)] if source else [])]
    env = dict(os.environ) if epoch is None else {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500, env=env)


@pytest.fixture(scope="module")
def archive() -> Path:
    """`make image` (nothing to do when the archive is newer than its inputs); its time is printed."""
    need(os.geteuid() == 0, "needs root (mmdebstrap --mode=root, containerd)")
    for tool in ("make", "mmdebstrap", "containerd", "ctr", "containerd-shim-runc-v2", "runc"):
        need(shutil.which(tool) is not None, f"{tool} not installed (make system-deps)")
    started = time.monotonic()
    done = make_image()
    assert done.returncode == 0, f"make image failed:\n{done.stdout}\n{done.stderr}"
    print(f"make image: {time.monotonic() - started:.1f} s {done.stdout.strip()}")
    return ARCHIVE


def read_image(path: Path) -> tuple[dict[str, object], dict[str, object], list[tarfile.TarInfo]]:
    """The archive's index, its image config and the members of its one layer."""
    with tarfile.open(path) as outer:
        def blob(digest: str) -> bytes:
            member = outer.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return member.read()

        index = json.loads(outer.extractfile("index.json").read())  # type: ignore[union-attr]
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        assert len(manifest["layers"]) == 1
        layer = outer.extractfile(f"blobs/sha256/{manifest['layers'][0]['digest'].removeprefix('sha256:')}")
        with tarfile.open(fileobj=layer, mode="r|gz") as inner:
            members = list(inner)
    return index, config, members


class Containerd:
    """A private containerd: root, state, sockets in a temp dir; no CRI; stopped by its own pid."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.address = str(base / "containerd.sock")
        config = base / "config.toml"
        config.write_text(f"""version = 2
root = "{base}/root"
state = "{base}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{self.address}"
[ttrpc]
  address = "{self.address}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
""")
        self.log = open(base / "containerd.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(["containerd", "--config", str(config)], stdout=self.log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"private containerd did not come up: {(base / 'containerd.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["ctr", "--address", self.address, "--namespace", NAMESPACE, *args],
                              capture_output=True, text=True, timeout=timeout)
        if check:
            assert done.returncode == 0, f"ctr {' '.join(args)}: {done.stderr}{done.stdout}"
        return done

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.log.close()
        with open("/proc/self/mounts") as mounts:  # whatever a failed run left mounted under our root
            left = [line.split()[1] for line in mounts if line.split()[1].startswith(str(self.base))]
        for mountpoint in sorted(left, reverse=True):
            subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def containerd(archive: Path) -> Iterator[Containerd]:
    base = Path(tempfile.mkdtemp(prefix="ctd-", dir="/tmp"))  # short: unix socket paths
    daemon = Containerd(base)
    try:
        started = time.monotonic()
        imported = daemon.ctr("images", "import", str(archive), timeout=300)
        print(f"ctr images import: {time.monotonic() - started:.1f} s")
        assert NAME in imported.stdout + daemon.ctr("images", "ls", "-q").stdout
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_image(daemon: Containerd, *args: str) -> subprocess.CompletedProcess[str]:
    """`ctr run` of devinject in the image as the DaemonSet runs it (read-only root), the fixture host at
    /fixture (ctr's arguments replace the image's entrypoint: the test of that is below)."""
    return daemon.ctr("run", "--rm", "--read-only",
                      "--mount", f"type=bind,src={FIXTURE},dst=/fixture,options=rbind:ro",
                      NAME, f"devinject-{uuid.uuid4().hex[:8]}", "devinject", *args, check=False, timeout=120)


def test_image_runs_devinject_version(containerd: Containerd) -> None:
    done = run_image(containerd, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"devinject, version {VERSION}\n"


def test_image_lists_the_fixture_host(containerd: Containerd) -> None:
    done = run_image(containerd, "list", "--root", "/fixture")
    assert done.returncode == 0, done.stderr
    here = subprocess.run([DEVINJECT, "list", "--root", str(FIXTURE)], capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout == here.stdout  # the same table as this checkout's devinject prints
    assert done.stdout.count("nvidia.com/gpu=") >= 8 and done.stderr == ""


def test_image_entrypoint_is_devinject(containerd: Containerd) -> None:
    done = containerd.ctr("run", "--rm", "--read-only", NAME, f"devinject-{uuid.uuid4().hex[:8]}", check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: devinject device-plugin [OPTIONS]")  # Entrypoint + Cmd


def test_image_python_never_compiles_on_its_read_only_root(containerd: Containerd) -> None:
    """Every module devinject imports loads from a valid precompiled file: on the DaemonSet's read-only root
    Python could never cache what it compiles, and would compile it again on each start."""
    done = containerd.ctr("run", "--rm", "--read-only", NAME, f"devinject-{uuid.uuid4().hex[:8]}",
                          "python3", "-I", "-v", "-c", IMPORT_ALL, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = [line for line in done.stderr.splitlines() if line.startswith("# code object from ")]
    assert len(loaded) > 200 and any("/dist-packages/grpc/" in line for line in loaded)
    assert [line for line in loaded if not line.endswith(".pyc'")] == []
    assert "could not create" not in done.stderr


VERSIONS = """import importlib.metadata as m
for requirement in m.requires("devinject"):
    if "extra ==" in requirement:  # dev tools, not in the image
        continue
    name = requirement.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
    print(requirement, m.version(name), sep="|")
"""


def test_image_meets_devinjects_dependencies(containerd: Containerd) -> None:
    """Debian's packages and the pinned wheels, as the image's Python sees them, meet pyproject.toml."""
    done = containerd.ctr("run", "--rm", "--read-only", NAME, f"devinject-{uuid.uuid4().hex[:8]}",
                          "python3", "-I", "-c", VERSIONS, check=False)
    assert done.returncode == 0, done.stderr
    found = dict(line.split("|") for line in done.stdout.splitlines())
    assert {Requirement(r).name for r in found} >= {"click", "pyyaml", "grpcio", "protobuf", "pyroute2"}
    assert [(r, v) for r, v in found.items() if not Requirement(r).specifier.contains(v)] == []


def test_image_holds_only_what_the_agent_runs(archive: Path) -> None:
    index, config, members = read_image(archive)
    annotations = index["manifests"][0]["annotations"]  # type: ignore[index]
    assert annotations["io.containerd.image.name"] == NAME
    assert config["config"]["Entrypoint"] == ["devinject"]  # type: ignore[index]
    names = {m.name for m in members}
    unpacked = sum(m.size for m in members) / MIB
    print(f"image: {unpacked:.1f} MiB of files, {archive.stat().st_size / MIB:.1f} MiB archive, "
          f"{len(names)} entries")
    assert "usr/local/bin/devinject" in names and "usr/bin/python3.11" in names
    assert unpacked < UNPACKED_MAX_MIB
    unwanted = [n for n in names if n.startswith(("usr/share/man/", "usr/share/info/", "usr/share/locale/",
                                                    "var/lib/apt/", "var/cache/", "var/log/", "usr/lib/gcc"))
                or (n.startswith("usr/share/doc/") and n.count("/") > 3 and not n.endswith("/copyright"))
                or os.path.basename(n) in ("gcc", "cc", "pip", "pip3", "apt", "apt-get", "perl")
                or n.endswith(("/pip", "/ensurepip", "/setuptools"))
                or n in ("etc/resolv.conf", "etc/hostname", "etc/machine-id")]  # the build host's
    assert unwanted == []
    assert not [m.name for m in members if m.isdev() or m.uname or m.gname or m.mtime > config_created(config)]
    sources = {n for n in names if n.startswith("usr/local/lib/") and n.endswith(".py")}
    compiled = {n for n in names if n.endswith(".pyc")}
    uncompiled = [s for s in sources if not any(c.startswith(os.path.dirname(s) + "/__pycache__/"
                                                                + os.path.basename(s)[:-3] + ".") for c in compiled)]
    assert sources and uncompiled == []


def config_created(config: dict[str, object]) -> float:
    return time.mktime(time.strptime(str(config["created"]), "%Y-%m-%dT%H:%M:%SZ")) - time.timezone


def test_image_build_is_reproducible(archive: Path, tmp_path: Path) -> None:
    """Two builds of one source tree (a copy: the checkout may change meanwhile) from the same cached Debian
    tree, at one SOURCE_DATE_EPOCH (by default the last commit's time), are byte for byte the same archive."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "src" / "devinject", source / "src" / "devinject")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    builds = [tmp_path / "first.tar", tmp_path / "second.tar"]
    for build in builds:
        done = make_image(build, epoch=1_700_000_000, source=source)
        assert done.returncode == 0, done.stderr
    assert builds[0].read_bytes() == builds[1].read_bytes()


FOLLOW_JOURNAL = """import sys, time
from devinject.agent import kernelmsg
from devinject.discovery.host import Host
source = kernelmsg.open_source(Host("/host"), "auto")
print(type(source).__name__, source.description, flush=True)
print("read:", b"|".join(m.text for m in source.messages()).decode(), flush=True)
source.read()  # the first look notes the newest entry
print("following", flush=True)
deadline, got = time.monotonic() + 60, b""
while b"Xid" not in got and time.monotonic() < deadline:
    time.sleep(0.05)
    if source.pending():
        got += source.read()
print("followed:", got.decode(errors="replace"), flush=True)
source.close()
"""


def test_image_reads_a_journald_only_nodes_journal(containerd: Containerd, tmp_path: Path) -> None:
    """A node whose kernel messages reach the journal alone (no kern.log, /dev/kmsg closed to the pod): the
    image's journalctl reads the node's journal directory mounted read-only as the DaemonSets mount the host
    (/host), `--kernel-log auto` picks the journal, the follower sees an Xid appended while it runs, and
    `devinject health` in the image calls the GPU unhealthy for it. Fails on the image before, which had no
    journalctl (auto fell back to the missing kern.log and saw no Xid)."""
    from tests.integration.test_kernel_sources import write_journal, xid

    root = tmp_path / "host"
    shutil.copytree(FIXTURE, root, symlinks=True)
    (root / "var/log/kern.log").unlink(missing_ok=True)
    boot = uuid.uuid4().hex
    (root / "proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(str(uuid.UUID(boot)) + "\n")
    journal = root / "var/log/journal" / uuid.uuid4().hex  # a machine id
    journal.mkdir(parents=True)
    write_journal(journal, boot, "Linux version 6.1.0")
    for path in (tmp_path, root, *root.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)
    mount = ["--mount", f"type=bind,src={root},dst=/host,options=rbind:ro"]

    def in_image(*args: str) -> list[str]:
        return ["ctr", "--address", containerd.address, "--namespace", NAMESPACE, "run", "--rm", "--read-only",
                *mount, NAME, f"devinject-{uuid.uuid4().hex[:8]}", *args]

    listed = subprocess.run(in_image("journalctl", "--directory", f"/host/var/log/journal/{journal.name}",
                                     "-o", "json", "_TRANSPORT=kernel"), capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["MESSAGE"] for line in listed.stdout.splitlines()] == ["Linux version 6.1.0"]
    follower = subprocess.Popen(in_image("python3", "-I", "-c", FOLLOW_JOURNAL), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = follower.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("following"):
                break
        assert lines and lines[0].startswith("Journal the journal (/host/var/log/journal"), (lines, follower.stderr)
        assert lines[1] == "read: Linux version 6.1.0\n"
        write_journal(journal, boot, xid())
        out, err = follower.communicate(timeout=90)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(10)
    assert follower.returncode == 0, err
    assert f"followed: {xid()}" in out, (out, err)
    health = subprocess.run(in_image("devinject", "health", "--root", "/host", "--json"), capture_output=True,
                            text=True, timeout=120)
    verdicts = {d["pci_address"]: d for d in json.loads(health.stdout)}
    assert verdicts["0000:18:00.0"]["health"] == "unhealthy", health.stderr
    assert any("Xid 79" in r for r in verdicts["0000:18:00.0"]["reasons"]), verdicts["0000:18:00.0"]
    assert verdicts["0000:2a:00.0"]["health"] == "healthy"
