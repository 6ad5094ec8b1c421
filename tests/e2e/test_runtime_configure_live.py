"""`devinject runtime configure` against the real containerd binaries: the bundled containerd 1.7 reads the edited
config as meant (`config dump`: CDI on, the spec dirs set, nothing else changed, from no config and from its own
default one), starts on it with its CRI plugin loaded, and reads the default back after --revert; Debian's
containerd 1.6 is told it applies no CDI. Run under the shared lock (it starts a containerd)."""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import require
from tests.e2e.kube import KUBE

DEVINJECT = str(Path(sys.executable).parent / "devinject")
BUNDLED = KUBE / "containerd.xz"


@pytest.fixture(scope="module")
def containerd_17() -> Iterator[Path]:
    require(BUNDLED.exists(), f"the bundled containerd 1.7 ({BUNDLED})")
    base = Path(tempfile.mkdtemp(prefix="rcl-", dir="/tmp"))
    binary = base / "containerd"
    binary.write_bytes(lzma.decompress(BUNDLED.read_bytes()))
    binary.chmod(0o755)
    try:
        yield binary
    finally:
        shutil.rmtree(base, ignore_errors=True)


def configure(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "containerd", "--config", str(config),
                           *args], capture_output=True, text=True, timeout=60)


def dump(binary: Path, config: Path) -> str:
    done = subprocess.run([str(binary), "--config", str(config), "config", "dump"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def changed(before: str, after: str) -> list[str]:
    return sorted(set(after.splitlines()) - set(before.splitlines()))


def test_from_its_default_config_only_cdi_changes_and_revert_restores_it(containerd_17: Path, tmp_path: Path):
    config = tmp_path / "config.toml"
    default = subprocess.run([str(containerd_17), "config", "default"], capture_output=True, text=True, timeout=60)
    config.write_text(default.stdout)
    before = dump(containerd_17, config)
    # the containerd on PATH may be another (Debian's 1.6): the bundled one is named by its version
    done = configure(config, "--runtime-version", "1.7", "--spec-dir", "/etc/cdi", "--spec-dir", "/var/run/cdi")
    assert done.returncode == 0, done.stderr
    after = dump(containerd_17, config)
    assert changed(before, after) == ["    enable_cdi = true"]
    assert '    cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]' in after
    assert configure(config, "--runtime-version", "1.7").returncode == 0
    assert dump(containerd_17, config) == after  # idempotent
    assert configure(config, "--runtime-version", "1.7", "--revert").returncode == 0
    assert config.read_text() == default.stdout and dump(containerd_17, config) == before


def test_from_no_config(containerd_17: Path, tmp_path: Path):
    config = tmp_path / "config.toml"
    done = configure(config, "--runtime-version", "1.7", "--spec-dir", str(tmp_path / "cdi"))
    assert done.returncode == 0, done.stderr
    text = dump(containerd_17, config)
    assert "    enable_cdi = true" in text and f'    cdi_spec_dirs = ["{tmp_path / "cdi"}"]' in text


def test_containerd_17_starts_on_the_configured_config_with_its_cri_plugin(containerd_17: Path):
    base = Path(tempfile.mkdtemp(prefix="rcs-", dir="/tmp"))  # short: unix socket paths
    address = base / "c.sock"
    config = base / "config.toml"
    config.write_text(f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n[grpc]\n  address = "{address}"\n'
                      f'[ttrpc]\n  address = "{address}.ttrpc"\n')
    assert configure(config, "--runtime-version", "1.7").returncode == 0
    log = open(base / "log", "w")  # noqa: SIM115 (closed below)
    daemon = subprocess.Popen([str(containerd_17), "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            plugins = subprocess.run(["ctr", "--address", str(address), "plugins", "ls"], capture_output=True,
                                     text=True, timeout=30)
            if plugins.returncode == 0:
                break
            assert daemon.poll() is None and time.monotonic() < deadline, (base / "log").read_text()[-2000:]
            time.sleep(0.2)
        cri = [line.split() for line in plugins.stdout.splitlines() if "io.containerd.grpc.v1" in line
               and line.split()[1] == "cri"]
        assert cri and cri[0][-1] == "ok", plugins.stdout
        assert "enable_cdi:true" in (base / "log").read_text().replace(" ", "").replace('"', "").replace(
            "EnableCDI:true", "enable_cdi:true")
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def test_debians_containerd_16_is_told_cdi_is_not_applied(tmp_path: Path):
    require(shutil.which("containerd") is not None and os.path.realpath(shutil.which("containerd") or "")
            .startswith("/usr/bin"), "Debian's containerd in /usr/bin")
    version = subprocess.run(["containerd", "--version"], capture_output=True, text=True, timeout=30).stdout
    require(" 1.6." in version, f"Debian's containerd is 1.6 ({version.strip()})")
    done = configure(tmp_path / "config.toml")
    assert done.returncode == 1 and "applies no CDI" in done.stderr and "install-hook" in done.stderr
    assert not (tmp_path / "config.toml").exists()
