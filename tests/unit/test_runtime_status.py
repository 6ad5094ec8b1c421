"""What doctor's runtime link reads of each runtime's configuration under a root: CDI applied or not, from which
spec dirs, pod annotations passed through; a config `runtime configure` wrote reads as CDI on."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from devinject.runtimes import daemons
from devinject.runtimes.daemons import command_flags, crio_paths, running_crio
from devinject.runtimes.status import detect, runtime_status


def _write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_no_runtime_found_is_broken_with_a_fix(tmp_path: Path):
    status = runtime_status(str(tmp_path))
    assert not status.applies and "no container runtime's configuration" in status.detail and status.fix


def test_containerd_off_then_configured_on(tmp_path: Path):
    _write(tmp_path, "/etc/containerd/config.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n'
           '  sandbox_image = "pause"\n')
    assert detect(str(tmp_path)) == ["containerd"]
    status = runtime_status(str(tmp_path))
    assert not status.applies and "enable_cdi is off" in status.detail
    assert status.fix and "runtime configure --runtime containerd" in status.fix
    config = tmp_path / "etc/containerd/config.toml"
    done = CliRunner().invoke(cli, ["runtime", "configure", "--runtime", "containerd", "--config", str(config),
                                    "--runtime-version", "1.7", "--spec-dir", "/var/run/cdi"])
    assert done.exit_code == 0, done.output
    status = runtime_status(str(tmp_path))
    assert status.applies and status.spec_dirs == ("/var/run/cdi",) and status.warning is None


def test_containerd_2_reads_cdi_on_by_default(tmp_path: Path):
    _write(tmp_path, "/etc/containerd/config.toml", "version = 3\n")
    status = runtime_status(str(tmp_path), "containerd")
    assert status.applies and status.spec_dirs == ("/etc/cdi", "/var/run/cdi")


def test_crio_and_podman_read_their_drop_ins(tmp_path: Path):
    _write(tmp_path, "/etc/crio/crio.conf", "[crio.runtime]\n")
    _write(tmp_path, "/etc/crio/crio.conf.d/99-devinject.conf", '[crio.runtime]\ncdi_spec_dirs = ["/x"]\n')
    assert runtime_status(str(tmp_path), "crio").spec_dirs == ("/x",)
    _write(tmp_path, "/etc/containers/containers.conf", "[engine]\n")
    assert runtime_status(str(tmp_path), "podman").spec_dirs == ("/etc/cdi", "/var/run/cdi")


def test_podman_before_5_5_ignores_cdi_spec_dirs(tmp_path: Path):
    """podman 4.3 resolves `--device` only from CDI's default dirs whatever containers.conf says
    (tests/e2e/test_doctor_live.py); a podman of unknown version is taken at its config's word."""
    _write(tmp_path, "/etc/containers/containers.conf.d/99-devinject.conf", '[engine]\ncdi_spec_dirs = ["/x"]\n')
    old = runtime_status(str(tmp_path), "podman", version="4.3.1")
    assert old.applies and old.spec_dirs == ("/etc/cdi", "/var/run/cdi")
    assert old.detail \
        == "podman 4.3.1 applies CDI from /etc/cdi, /var/run/cdi (it ignores containers.conf's cdi_spec_dirs /x)"
    assert runtime_status(str(tmp_path), "podman", version="5.5.0").spec_dirs == ("/x",)
    assert runtime_status(str(tmp_path), "podman").spec_dirs == ("/x",)


def test_docker_needs_features_cdi(tmp_path: Path):
    _write(tmp_path, "/etc/docker/daemon.json", '{"log-driver": "journald"}')
    status = runtime_status(str(tmp_path), "docker")
    assert not status.applies and "features.cdi is not set" in status.detail
    _write(tmp_path, "/etc/docker/daemon.json", '{"features": {"cdi": true}}')
    assert runtime_status(str(tmp_path), "docker").applies


def test_runc_needs_the_hook(tmp_path: Path):
    status = runtime_status(str(tmp_path), "runc")
    assert not status.applies and status.fix and "install-hook --runc-snippet" in status.fix
    _write(tmp_path, "/etc/containers/oci/hooks.d/10-devinject.json", "{}")
    assert runtime_status(str(tmp_path), "runc").applies


def test_crio_paths_from_its_command_line():
    assert crio_paths([]) == ("/etc/crio/crio.conf", "/etc/crio/crio.conf.d")
    assert crio_paths(["--config", "/opt/c.conf", "--config-dir=/opt/d"]) == ("/opt/c.conf", "/opt/d")
    assert crio_paths(["-c", "/a", "-d", "/b", "--log-level", "info"]) == ("/a", "/b")
    assert crio_paths(["--config-dir"]) == ("/etc/crio/crio.conf", "/etc/crio/crio.conf.d")


def test_the_running_crio_is_roots_process_named_crio(tmp_path: Path):
    """Anyone can name a process crio: only one root runs is read (its /proc entry is root's)."""
    for pid, name, argv in ((7, "crio", "/usr/bin/crio\0--config-dir\0/opt/d\0"), (3, "bash", "bash\0")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(name + "\n")
        (tmp_path / str(pid) / "cmdline").write_text(argv)
    assert running_crio(str(tmp_path)) == (7, ("/etc/crio/crio.conf", "/opt/d"))
    os.chown(tmp_path / "7", 1000, 1000)
    assert running_crio(str(tmp_path)) is None


def test_crio_started_with_another_config_dir_is_read_there_and_its_fix_writes_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On this machine's root doctor reads the running CRI-O's --config and --config-dir (its command line), and
    the fix it names configures that dir; applied, CRI-O's dirs include devinject's."""
    (tmp_path / "d").mkdir()
    (tmp_path / "crio.conf").write_text("[crio.runtime]\ncdi_spec_dirs = ['/opt/vendor']\n")
    monkeypatch.setattr(daemons, "running_crio", lambda: (42, (str(tmp_path / "crio.conf"), str(tmp_path / "d"))))
    status = runtime_status("/", "crio")
    assert status.spec_dirs == ("/opt/vendor",) and f"pid 42's --config-dir {tmp_path}/d" in status.detail
    assert status.configure == (f"devinject runtime configure --runtime crio --config {tmp_path}/crio.conf "
                                f"--config-dir {tmp_path}/d")
    done = CliRunner().invoke(cli, [*status.configure.split()[1:], "--spec-dir", "/opt/vendor", "--spec-dir",
                                    "/var/run/cdi"])
    assert done.exit_code == 0, done.output
    assert runtime_status("/", "crio").spec_dirs == ("/opt/vendor", "/var/run/cdi")


def test_a_running_containerd_is_read_from_its_own_config_at_its_own_version(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """On this machine's root doctor reads the config the running containerd was started with, at that binary's
    version (the PATH's may be another: Debian's 1.6 here); its fix names both, and applied, the link holds."""
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n")
    monkeypatch.setattr(daemons, "running_containerd", lambda: (42, str(config), "2.3.4"))
    status = runtime_status("/", "containerd")
    assert status.applies and status.spec_dirs == ("/etc/cdi", "/var/run/cdi")
    assert f"containerd 2.3.4 applies CDI from /etc/cdi, /var/run/cdi ({config}; pid 42's --config)" == status.detail
    assert status.configure == f"devinject runtime configure --runtime containerd --runtime-version 2.3.4 --config " \
                               f"{config}"
    done = CliRunner().invoke(cli, [*status.configure.split()[1:], "--spec-dir", "/opt/cdi"])
    assert done.exit_code == 0, done.output
    assert tomllib.loads((tmp_path / "conf.d/99-devinject.toml").read_text())["version"] == 2
    assert runtime_status("/", "containerd").spec_dirs == ("/opt/cdi",)


def test_command_flags():
    aliases = {"--config": "config", "-c": "config"}
    assert command_flags(["-c", "/a"], aliases, {"config": "/d"}) == {"config": "/a"}
    assert command_flags(["--config=/b", "--log-level", "debug"], aliases, {"config": "/d"}) == {"config": "/b"}
    assert command_flags(["--log-level", "debug"], aliases, {"config": "/d"}) == {"config": "/d"}


def test_configure_on_this_machine_writes_where_the_running_runtime_reads(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Without --config / --config-dir, configure on / takes the running CRI-O's and containerd's own (root's
    process, its command line), and containerd's binary's version."""
    (tmp_path / "crio.conf").write_text("[crio.runtime]\n")
    monkeypatch.setattr(daemons, "running_crio", lambda: (7, (str(tmp_path / "crio.conf"), str(tmp_path / "d"))))
    done = CliRunner().invoke(cli, ["runtime", "configure", "--runtime", "crio", "--spec-dir", "/opt/cdi"])
    assert done.exit_code == 0 and f"wrote {tmp_path}/d/99-devinject.conf" in done.output, done.output
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    monkeypatch.setattr(daemons, "running_containerd", lambda: (8, str(config), "2.3.4"))
    done = CliRunner().invoke(cli, ["runtime", "configure", "--runtime", "containerd", "--spec-dir", "/opt/cdi"])
    assert done.exit_code == 0, done.output
    assert tomllib.loads((tmp_path / "conf.d/99-devinject.toml").read_text())["version"] == 2  # 2.3.4's drop-in


def test_a_containerd_of_another_pid_namespace_is_a_containers_never_the_nodes(tmp_path: Path) -> None:
    """A kind node's or docker-in-docker's `containerd` runs as root in a pid namespace of its own: its binary
    is the image's, and devinject asked it `--version` as root (and took its --config). docker's scan already
    refused such a process; the shared one (runtimes/daemons.py) now does too."""
    import shutil
    import subprocess
    import time

    from devinject.runtimes import daemons

    fake = tmp_path / "containerd"
    shutil.copy("/bin/sleep", fake)
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", str(fake), "30"])
    inner = None
    try:
        for _ in range(200):  # unshare forks the fake as pid 1 of the new namespace
            children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children")
            kids = children.read_text().split() if children.exists() else []
            if kids and Path(f"/proc/{kids[0]}/comm").read_text().strip() == "containerd":
                inner = int(kids[0])
                break
            time.sleep(0.02)
        assert inner is not None, "the fake containerd did not start"
        assert daemons.running_daemon("containerd", "/proc", [inner]) is None
        assert daemons.running_containerd("/proc", [inner]) is None
        here = subprocess.Popen([str(fake), "30"])  # the same binary in this pid namespace is the node's
        try:
            for _ in range(200):
                if Path(f"/proc/{here.pid}/comm").read_text().strip() == "containerd":
                    break
                time.sleep(0.02)
            assert daemons.running_daemon("containerd", "/proc", [inner, here.pid]) == (here.pid, ["30"])
        finally:
            here.kill()
            here.wait()
    finally:
        outer.terminate()  # --kill-child: the namespace's pid 1 goes with it
        outer.wait()
        if inner is not None and Path(f"/proc/{inner}").exists():
            os.kill(inner, 9)
