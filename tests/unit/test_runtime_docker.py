"""docker's side of `devinject runtime configure` and of doctor's runtime link (runtimes/docker.py): only what
the version needs, never a key a dockerd flag sets, an admin's values kept, `--revert` exactly what devinject
did (from its record), a BOM kept, a daemon.json dockerd would refuse refused. The same rules checked against the
real dockerd's own `--validate` in tests/e2e/test_docker_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from devinject.core.errors import ConfigError
from devinject.runtimes import docker
from devinject.runtimes.docker import Daemon, DaemonFlags, exec_start, parse_flags

DEFAULTS = ["/etc/cdi", "/var/run/cdi"]


def configure(config: Path, *args: str) -> tuple[int, str]:
    done = CliRunner().invoke(cli, ["runtime", "configure", "--runtime", "docker", "--config", str(config), *args])
    return done.exit_code, done.output


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---- dockerd's command line and unit -----------------------------------------------------------------------

def test_flags_are_read_as_pflag_reads_them():
    flags = parse_flags(["dockerd", "-H", "fd://", "--cdi-spec-dir", "/a", "--cdi-spec-dir=/b,/c",
                         "--config-file=/x.json", "--feature", "cdi=false", "--feature=containerd-snapshotter"], "here")
    assert flags.config_file == "/x.json" and flags.spec_dirs == ("/a", "/b", "/c")
    assert flags.features == {"cdi": False, "containerd-snapshotter": True}
    assert parse_flags(["dockerd", "--debug"], "here") == DaemonFlags("here", args=("dockerd", "--debug"))


def test_the_validate_command_line_drops_the_daemons_own_config_file():
    args = ("/usr/bin/dockerd", "-H", "fd://", "--config-file", "/etc/docker/daemon.json", "--config-file=/x",
            "--validate", "--debug")
    assert docker.without_config_file(args) == ["/usr/bin/dockerd", "-H", "fd://", "--debug"]


def test_exec_start_is_the_last_after_drop_ins_and_resets():
    unit = "[Service]\nExecStart=/usr/bin/dockerd -H fd:// \\\n  --containerd=/run/containerd/containerd.sock\n"
    assert exec_start([unit]) == ["/usr/bin/dockerd", "-H", "fd://", "--containerd=/run/containerd/containerd.sock"]
    drop_in = "[Service]\nExecStart=\nExecStart=-/usr/bin/dockerd --cdi-spec-dir '/opt/my cdi'\n"
    assert exec_start([unit, drop_in]) == ["/usr/bin/dockerd", "--cdi-spec-dir", "/opt/my cdi"]
    assert exec_start(["[Service]\nExecStart=\n"]) is None


def _unit(root: Path, text: str, drop_in: str | None = None) -> None:
    unit = root / "lib/systemd/system/docker.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(text)
    if drop_in is not None:
        (root / "etc/systemd/system/docker.service.d").mkdir(parents=True, exist_ok=True)
        (root / "etc/systemd/system/docker.service.d/override.conf").write_text(drop_in)


def _process(root: Path, pid: int, *args: str) -> None:
    (root / "proc" / str(pid)).mkdir(parents=True)
    (root / "proc" / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")


def test_the_daemon_reading_the_file_is_found_under_the_root(tmp_path: Path):
    config = tmp_path / "etc/docker/daemon.json"
    _process(tmp_path, 10, "/usr/bin/dockerd", "--config-file", "/other.json", "--cdi-spec-dir", "/elsewhere")
    _process(tmp_path, 11, "/usr/bin/containerd")
    assert docker.find_daemon(str(tmp_path), str(config)).spec_dirs is None  # another daemon's file
    _process(tmp_path, 12, "/usr/bin/dockerd", "--cdi-spec-dir", "/run/cdi")
    found = docker.find_daemon(str(tmp_path), str(config))
    assert found.pid == 12 and found.spec_dirs == (("/run/cdi",), f"{tmp_path}/proc/12/cmdline")
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd -H fd://\n",
          "[Service]\nExecStart=\nExecStart=/usr/bin/dockerd --feature cdi=true\n")
    assert docker.find_daemon(str(tmp_path), str(config)).features == ({"cdi": True}, str(
        tmp_path / "lib/systemd/system/docker.service") + " + " + str(
        tmp_path / "etc/systemd/system/docker.service.d/override.conf"))


# ---- configure: what each version needs ---------------------------------------------------------------------

def test_28_2_and_later_need_nothing_for_the_default_dirs(tmp_path: Path):
    config = tmp_path / "daemon.json"
    code, out = configure(config, "--runtime-version", "29.7.2")
    assert code == 0 and "already configured" in out and not list(tmp_path.iterdir())
    config.write_text('{"log-driver": "journald"}')
    code, out = configure(config, "--runtime-version", "28.2")
    assert code == 0 and "already configured" in out and files(tmp_path) == {"daemon.json": b'{"log-driver": '
                                                                             b'"journald"}'}


def test_28_2_with_another_spec_dir_gets_it_beside_the_defaults(tmp_path: Path):
    config = tmp_path / "daemon.json"
    code, out = configure(config, "--runtime-version", "28.2.2", "--spec-dir", "/opt/devinject/cdi")
    assert code == 0, out
    assert json.loads(config.read_text()) == {"cdi-spec-dirs": [*DEFAULTS, "/opt/devinject/cdi"]}  # no features


def test_25_to_28_1_get_features_cdi_and_keep_the_other_keys(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text(json.dumps({"log-driver": "journald", "features": {"buildkit": True}}))
    code, _ = configure(config, "--runtime-version", "27.5")
    assert code == 0
    assert json.loads(config.read_text()) == {"log-driver": "journald", "features": {"buildkit": True, "cdi": True}}
    code, out = configure(config, "--runtime-version", "27.5")
    assert code == 0 and "already configured" in out


def test_docker_24_gets_one_line_and_nothing_written(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text('{"debug": true}\n')
    code, out = configure(config, "--runtime-version", "24.0.9")
    assert code == 1 and len(out.splitlines()) == 1
    assert "applies no CDI" in out and "install-hook" in out
    assert files(tmp_path) == {"daemon.json": b'{"debug": true}\n'}


def test_the_version_given_is_the_one_used(tmp_path: Path):
    config = tmp_path / "daemon.json"
    configure(config, "--runtime-version", "28.1.1")
    assert json.loads(config.read_text()) == {"features": {"cdi": True}}  # 28.1: CDI needs the feature
    with pytest.raises(ConfigError, match="version is unknown"):
        docker.plan_configure(str(config), None, None, version=None, daemon=Daemon(), spec_dirs=DEFAULTS)


# ---- never a key a flag sets ----------------------------------------------------------------------------------

def test_a_spec_dir_flag_is_never_clashed_with(tmp_path: Path):
    config = tmp_path / "etc/docker/daemon.json"
    config.parent.mkdir(parents=True)
    config.write_text("{}")
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd -H fd:// --cdi-spec-dir /etc/cdi\n")
    with pytest.raises(ConfigError) as err:
        docker.configure(str(config), ["/etc/cdi", "/var/run/cdi"], version="29.1", revert=False, root=str(tmp_path))
    assert "add --cdi-spec-dir /var/run/cdi there" in err.value.message and "\n" not in err.value.message
    assert files(config.parent) == {"daemon.json": b"{}"}
    # what the flags already give is enough: nothing to write
    plan = docker.configure(str(config), ["/etc/cdi"], version="29.1", revert=False, root=str(tmp_path))
    assert plan.changes == ()
    # a file that already clashes (dockerd does not start): named, not made worse
    config.write_text('{"cdi-spec-dirs": ["/etc/cdi"]}')
    with pytest.raises(ConfigError, match="set here and by dockerd's --cdi-spec-dir"):
        docker.configure(str(config), ["/etc/cdi"], version="29.1", revert=False, root=str(tmp_path))


def test_a_feature_flag_is_never_clashed_with(tmp_path: Path):
    daemon = Daemon(unit=(flags := DaemonFlags("docker.service", features={"containerd-snapshotter": True})),
                    sources=(flags,))
    with pytest.raises(ConfigError, match=r"add --feature cdi=true there; nothing written"):
        docker.plan_configure("d.json", "{}", None, version="27.0", daemon=daemon, spec_dirs=DEFAULTS)
    on = Daemon(sources=(DaemonFlags("docker.service", features={"cdi": True}),))
    assert docker.plan_configure("d.json", "{}", None, version="27.0", daemon=on, spec_dirs=DEFAULTS).changes == ()


# ---- an admin's values ---------------------------------------------------------------------------------------

def test_an_admins_cdi_false_is_never_flipped(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text('{"features": {"cdi": false}}')
    for version in ("27.0", "29.7.2"):
        code, out = configure(config, "--runtime-version", version)
        assert code == 1 and len(out.splitlines()) == 1 and "features.cdi is false" in out, out
        assert "set it to true by hand" in out
    assert files(tmp_path) == {"daemon.json": b'{"features": {"cdi": false}}'}


def test_an_admins_spec_dirs_are_kept_and_never_reverted(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text('{"cdi-spec-dirs": ["/opt/vendor/cdi"]}')
    code, _ = configure(config, "--runtime-version", "29.0")
    assert code == 0
    assert json.loads(config.read_text()) == {"cdi-spec-dirs": ["/opt/vendor/cdi", *DEFAULTS]}
    config.write_text(config.read_text().replace("\n", "\n "))  # an admin's edit after: revert goes key by key
    code, _ = configure(config, "--revert")
    assert code == 0 and json.loads(config.read_text()) == {"cdi-spec-dirs": ["/opt/vendor/cdi"]}
    assert files(tmp_path).keys() == {"daemon.json"}


# ---- revert: exactly what devinject did -----------------------------------------------------------------------

ADMIN = '\ufeff{\r\n    "log-driver": "journald",   "features": {"buildkit": true}\r\n}'


@pytest.mark.parametrize(("before", "version", "dirs"), [
    (None, "27.0", ()),
    (None, "29.7.2", ("/opt/devinject",)),
    (ADMIN, "25.0.1", ("/opt/devinject", "/etc/cdi")),
    ('{"cdi-spec-dirs": ["/opt/vendor/cdi"]}', "28.0", ()),
])
def test_revert_restores_the_bytes_or_the_absence(tmp_path: Path, before: str | None, version: str,
                                                   dirs: tuple[str, ...]):
    config = tmp_path / "daemon.json"
    if before is not None:
        config.write_bytes(before.encode())
    spec_dirs = [arg for d in dirs for arg in ("--spec-dir", d)]
    code, out = configure(config, "--runtime-version", version, *spec_dirs)
    assert code == 0 and "wrote" in out, out
    code, out = configure(config, "--runtime-version", version, *spec_dirs, "--spec-dir", "/second")  # a second run
    assert code == 0 and "wrote" in out, out
    code, out = configure(config, "--revert")  # no --spec-dir: the record knows
    assert code == 0, out
    assert files(tmp_path) == ({"daemon.json": before.encode()} if before is not None else {})


def test_revert_after_already_configured_changes_nothing(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text('{"features":{"cdi":true},"cdi-spec-dirs":["/etc/cdi","/var/run/cdi"]}')
    before = files(tmp_path)
    code, out = configure(config, "--runtime-version", "27.1")
    assert code == 0 and "already configured" in out
    code, out = configure(config, "--revert")
    assert code == 0 and "nothing of devinject to take back" in out and files(tmp_path) == before


def test_revert_after_the_admin_edited_takes_back_only_devinjects_keys(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text('{"debug": true}')
    configure(config, "--runtime-version", "26.1", "--spec-dir", "/opt/devinject")
    data = json.loads(config.read_text())
    assert data == {"debug": True, "features": {"cdi": True}, "cdi-spec-dirs": [*DEFAULTS, "/opt/devinject"]}
    config.write_text(json.dumps({**data, "log-level": "warn"}))
    code, _ = configure(config, "--revert")
    assert code == 0 and json.loads(config.read_text()) == {"debug": True, "log-level": "warn"}
    assert files(tmp_path).keys() == {"daemon.json"}


@pytest.mark.parametrize("record", ["{not json", '{"kind": "something else"}',
                                    json.dumps({"kind": docker.RECORD_KIND, "version": 1, "written_sha256": "x"})])
def test_a_corrupt_record_is_one_line_and_nothing_is_lost(tmp_path: Path, record: str):
    config = tmp_path / "daemon.json"
    config.write_text('{"features": {"cdi": true}}')
    (tmp_path / "daemon.json.devinject").write_text(record)
    before = files(tmp_path)
    for args in (("--revert",), ("--runtime-version", "27.0", "--spec-dir", "/x")):
        code, out = configure(config, *args)
        assert code == 1 and len(out.splitlines()) == 1, out
        assert out.startswith(f"devinject: error: {config}.devinject: corrupt record") and "by hand" in out
        assert files(tmp_path) == before


# ---- what dockerd accepts --------------------------------------------------------------------------------------

def test_a_bom_is_accepted_and_kept(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_bytes(b'\xef\xbb\xbf{"debug": true}\n')
    code, out = configure(config, "--runtime-version", "27.0")
    assert code == 0, out
    assert config.read_bytes().startswith(b'\xef\xbb\xbf{\n  "debug": true,\n  "features"')


@pytest.mark.parametrize(("text", "why"), [
    ('{"debug": true,}', "not valid JSON"),
    ('{"debug": true}\n{"debug": false}', "not valid JSON: Extra data"),
    ('{"max-concurrent-downloads": NaN}', "NaN is not JSON"),
    ('["debug"]', "expected a JSON object"),
    ('{"features": {"cdi": "yes"}}', "features: expected an object of true/false"),
    ('{"cdi-spec-dirs": "/etc/cdi"}', "cdi-spec-dirs: expected a list of paths"),
])
def test_a_daemon_json_dockerd_refuses_is_refused(tmp_path: Path, text: str, why: str):
    config = tmp_path / "daemon.json"
    config.write_text(text)
    code, out = configure(config, "--runtime-version", "27.0")
    assert code == 1 and len(out.splitlines()) == 1 and why in out and str(config) in out, out
    assert files(tmp_path) == {"daemon.json": text.encode()}


def test_an_empty_file_is_no_settings(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text("")
    code, _ = configure(config, "--runtime-version", "27.0")
    assert code == 0 and json.loads(config.read_text()) == {"features": {"cdi": True}}
    configure(config, "--revert")
    assert config.read_text() == ""


# ---- doctor's runtime link ------------------------------------------------------------------------------------

def _daemon_json(root: Path, text: str) -> Path:
    config = root / "etc/docker/daemon.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    return config


def _status(root: Path, version: str | None, *, hook: bool = False) -> docker.DockerStatus:
    return docker.node_status(str(root), version=version, hook_installed=hook)


def test_doctor_on_28_2_and_later_without_daemon_json_reads_the_defaults(tmp_path: Path):
    found = _status(tmp_path, "29.7.2")
    assert found.applies and found.spec_dirs == tuple(DEFAULTS)
    assert "on by default since 28.2" in found.detail and "absent" in found.detail


@pytest.mark.parametrize("text", [None, '{"log-driver": "journald"}'])
def test_doctor_on_25_to_28_1_needs_features_cdi_and_its_fix_works(tmp_path: Path, text: str | None):
    if text is not None:
        _daemon_json(tmp_path, text)
    found = _status(tmp_path, "27.5.1")
    assert not found.applies and "features.cdi is not set" in found.detail and "before 28.2" in found.detail
    assert found.fix == "devinject runtime configure --runtime docker --runtime-version 27.5.1, then systemctl " \
                        "restart docker"
    code, _ = configure(tmp_path / "etc/docker/daemon.json", "--runtime-version", "27.5.1")
    assert code == 0 and _status(tmp_path, "27.5.1").applies


def test_doctor_with_the_version_unknown_does_not_guess(tmp_path: Path):
    _daemon_json(tmp_path, '{"log-driver": "journald"}')
    found = _status(tmp_path, None)
    assert not found.applies and "version is unknown" in found.detail
    _daemon_json(tmp_path, '{"features": {"cdi": true}}')
    assert _status(tmp_path, None).applies


def test_doctor_on_docker_24_wants_the_hook(tmp_path: Path):
    found = _status(tmp_path, "24.0.7")
    assert not found.applies and found.fix and "install-hook" in found.fix
    assert _status(tmp_path, "24.0.7", hook=True).applies


def test_doctor_names_an_admins_cdi_false(tmp_path: Path):
    _daemon_json(tmp_path, '{"features": {"cdi": false}}')
    found = _status(tmp_path, "29.0")
    assert not found.applies and "CDI is off" in found.detail
    assert found.fix and "set features.cdi to true" in found.fix


def test_doctor_reads_the_spec_dirs_of_the_command_line_and_names_the_flag_as_fix(tmp_path: Path):
    _daemon_json(tmp_path, "{}")
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd --cdi-spec-dir=/etc/cdi\n")
    found = _status(tmp_path, "29.0")
    assert found.applies and found.spec_dirs == ("/etc/cdi",) and "--cdi-spec-dir on dockerd's command line" \
        in found.detail
    assert found.spec_dir_fix and found.spec_dir_fix.startswith("add --cdi-spec-dir {spec_dir} to dockerd's command")
    # the fix applied: the unit gets the flag
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd --cdi-spec-dir=/etc/cdi --cdi-spec-dir /opt/x\n")
    assert _status(tmp_path, "29.0").spec_dirs == ("/etc/cdi", "/opt/x")


def test_doctor_names_a_clash_that_stops_dockerd(tmp_path: Path):
    _daemon_json(tmp_path, '{"cdi-spec-dirs": ["/etc/cdi"]}')
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd --cdi-spec-dir=/etc/cdi\n")
    found = _status(tmp_path, "29.0")
    assert not found.applies and "refuses to start" in found.detail and found.fix and "cdi-spec-dirs" in found.fix


def test_doctor_reads_the_daemon_json_dockerd_is_started_with(tmp_path: Path):
    _daemon_json(tmp_path, '{"features": {"cdi": false}}')
    other = tmp_path / "srv/docker.json"
    other.parent.mkdir(parents=True)
    other.write_text('{"features": {"cdi": true}, "cdi-spec-dirs": ["/srv/cdi"]}')
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd --config-file /srv/docker.json\n")
    found = _status(tmp_path, "27.0")
    assert found.applies and found.spec_dirs == ("/srv/cdi",) and str(other) in found.detail


def test_a_stock_docker_node_without_daemon_json_is_found(tmp_path: Path):
    from devinject.runtimes.status import detect, runtime_status

    assert detect(str(tmp_path)) == []
    dockerd = tmp_path / "usr/bin/dockerd"
    dockerd.parent.mkdir(parents=True)
    dockerd.write_text("")
    assert detect(str(tmp_path)) == ["docker"]
    found = runtime_status(str(tmp_path), version="29.7.2")
    assert found.runtime == "docker" and found.applies and found.spec_dirs == tuple(DEFAULTS)


def test_a_record_others_could_write_is_not_trusted(tmp_path: Path):
    """The attack: a record writable by others, rewritten to carry a `before` of the attacker's (a runtime of
    theirs as docker's default, run as root), with the SHA of the file as it is so revert would restore it."""
    config = tmp_path / "daemon.json"
    configure(config, "--runtime-version", "27.0")
    record = tmp_path / "daemon.json.devinject"
    forged = json.loads(record.read_text())
    forged["before"] = {"text": '{"default-runtime": "evil", "runtimes": {"evil": {"path": "/tmp/evil"}}}'}
    record.write_text(json.dumps(forged))
    record.chmod(0o666)
    before = files(tmp_path)
    code, out = configure(config, "--revert")
    assert code == 1 and "writable by others" in out and len(out.splitlines()) == 1
    assert files(tmp_path) == before
    record.unlink()
    record.symlink_to(tmp_path / "elsewhere")
    code, out = configure(config, "--revert")
    assert code == 1 and "not a plain file" in out


def test_doctor_on_an_empty_spec_dir_list_names_the_admins_fix(tmp_path: Path):
    config = _daemon_json(tmp_path, '{"cdi-spec-dirs": []}')
    found = _status(tmp_path, "29.0")
    assert not found.applies and "from no spec dir" in found.detail
    assert found.fix and found.fix.startswith(f"put the spec dirs into cdi-spec-dirs in {config}")
    code, out = configure(config, "--runtime-version", "29.0")  # configure does not override the admin
    assert code == 1 and "cdi-spec-dirs is empty" in out
    config.write_text('{"cdi-spec-dirs": ["/etc/cdi"]}')  # the fix, applied
    assert _status(tmp_path, "29.0").applies


def test_a_unit_others_can_write_is_not_read(tmp_path: Path):
    config = tmp_path / "etc/docker/daemon.json"
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd --cdi-spec-dir /elsewhere\n")
    assert docker.find_daemon(str(tmp_path), str(config)).spec_dirs is not None
    (tmp_path / "lib/systemd/system/docker.service").chmod(0o666)
    assert docker.find_daemon(str(tmp_path), str(config)).spec_dirs is None


def test_a_linked_daemon_json_is_changed_in_its_target(tmp_path: Path):
    managed = tmp_path / "managed"
    managed.mkdir()
    target = managed / "daemon.json"
    target.write_text('{"debug": true}')
    link = tmp_path / "daemon.json"
    link.symlink_to(target)
    code, out = configure(link, "--runtime-version", "27.0")
    assert code == 0, out
    assert link.is_symlink() and json.loads(target.read_text()) == {"debug": True, "features": {"cdi": True}}
    assert (managed / "daemon.json.devinject").exists()
    code, _ = configure(link, "--revert")
    assert code == 0 and link.is_symlink() and target.read_text() == '{"debug": true}'
    assert files(managed) == {"daemon.json": b'{"debug": true}'}
    target.chmod(0o666)  # a target others can write is not root's code
    code, out = configure(link, "--runtime-version", "27.0")
    # refused where every runtime's config link is resolved (runtimes/config.write_target), before docker's plan
    assert code == 1 and "a symbolic link to" in out and "writable by group or others" in out
    assert target.read_text() == '{"debug": true}'


@pytest.mark.parametrize(("flag", "version", "fix"), [
    ("--feature cdi=false", "29.0", "remove --feature cdi=false from dockerd's command line"),
    ("--feature containerd-snapshotter=true", "27.0", "add --feature cdi=true to dockerd's command line"),
])
def test_doctor_reads_features_from_the_command_line_and_its_fix_works(tmp_path: Path, flag: str, version: str,
                                                                        fix: str):
    _unit(tmp_path, f"[Service]\nExecStart=/usr/bin/dockerd {flag}\n")
    found = _status(tmp_path, version)
    assert not found.applies and found.fix and found.fix.startswith(fix), found
    _unit(tmp_path, "[Service]\nExecStart=/usr/bin/dockerd --feature cdi=true\n")  # the fix, applied
    assert _status(tmp_path, version).applies


def test_an_admins_explicit_default_dirs_stay_after_revert(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text('{"cdi-spec-dirs": ["/etc/cdi", "/var/run/cdi"]}')
    configure(config, "--runtime-version", "29.0", "--spec-dir", "/opt/x")
    config.write_text(json.dumps({**json.loads(config.read_text()), "debug": True}))  # an edit: key by key
    configure(config, "--revert")
    assert json.loads(config.read_text()) == {"cdi-spec-dirs": DEFAULTS, "debug": True}


def test_an_edit_between_two_configures_survives_revert(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text("{}")
    configure(config, "--runtime-version", "27.0")
    config.write_text(json.dumps({**json.loads(config.read_text()), "debug": True}))
    configure(config, "--runtime-version", "27.0", "--spec-dir", "/opt/x")
    configure(config, "--revert")
    assert json.loads(config.read_text()) == {"debug": True}  # not the first `{}`: the admin's edit stays


def test_revert_after_the_file_was_removed_drops_only_the_record(tmp_path: Path):
    config = tmp_path / "daemon.json"
    configure(config, "--runtime-version", "27.0")
    config.unlink()
    code, _ = configure(config, "--revert")
    assert code == 0 and not list(tmp_path.iterdir())
