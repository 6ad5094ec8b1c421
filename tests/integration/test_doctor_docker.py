"""`devinject doctor`'s runtime link on a docker node (a fixture host made live, as in test_doctor.py): each way
docker's link breaks, per version, names a fix that, applied as written, makes the link hold."""

from __future__ import annotations

import shlex
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from tests.integration.test_doctor import Live, live  # noqa: F401 - the fixture

DAEMON_JSON = "etc/docker/daemon.json"
UNIT = "lib/systemd/system/docker.service"


def runtime_link(host: Live, version: str) -> tuple[bool | None, str, str | None]:
    (check,) = [c for c in host.diagnose(runtime="docker", runtime_version=version)[0].checks if c.link == "runtime"]
    return check.ok, check.detail, check.fix


def apply_configure(host: Live, fix: str) -> None:
    """A `devinject runtime configure ...` fix run as written, on the host's daemon.json."""
    command = shlex.split(fix.split(", then ")[0])
    assert command[:3] == ["devinject", "runtime", "configure"], fix
    done = CliRunner().invoke(cli, [*command[1:], "--config", str(host.root / DAEMON_JSON)])
    assert done.exit_code == 0, done.output


@pytest.fixture
def docker_host(live: Live) -> Iterator[Live]:  # noqa: F811 - test_doctor's fixture
    (live.root / "etc/containerd/config.toml").unlink()
    yield live


def test_docker_27_without_daemon_json_is_fixed_by_the_named_commands(docker_host: Live):
    ok, detail, fix = runtime_link(docker_host, "27.5.1")
    assert ok is False and "features.cdi is not set" in detail and fix
    apply_configure(docker_host, fix)
    ok, detail, fix = runtime_link(docker_host, "27.5.1")  # CDI on, but from docker's default dirs
    assert ok is False and f"not {docker_host.cdi}" in detail and fix and f"--spec-dir {docker_host.cdi}" in fix
    apply_configure(docker_host, fix)
    ok, detail, _ = runtime_link(docker_host, "27.5.1")
    assert ok is True and str(docker_host.cdi) in detail


def test_docker_29_with_spec_dirs_on_its_command_line_is_fixed_by_the_flag(docker_host: Live):
    unit = docker_host.root / UNIT
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/dockerd -H fd:// --cdi-spec-dir /etc/cdi\n")
    ok, detail, fix = runtime_link(docker_host, "29.7.2")
    assert ok is False and "reads /etc/cdi, not" in detail and "--cdi-spec-dir on dockerd's command line" in detail
    assert fix and fix.startswith(f"add --cdi-spec-dir {docker_host.cdi} to dockerd's command line")
    unit.write_text(unit.read_text().rstrip("\n") + f" --cdi-spec-dir {docker_host.cdi}\n")  # the fix
    ok, detail, _ = runtime_link(docker_host, "29.7.2")
    assert ok is True and str(docker_host.cdi) in detail


def test_docker_24_needs_the_hook(docker_host: Live):
    ok, detail, fix = runtime_link(docker_host, "24.0.7")
    assert ok is False and "applies no CDI" in detail and fix and "install-hook" in fix
    hook = docker_host.root / "etc/containers/oci/hooks.d/10-devinject.json"
    hook.parent.mkdir(parents=True)
    hook.write_text("{}")
    assert runtime_link(docker_host, "24.0.7")[0] is True
