"""`devinject runtime configure` for containerd 2.x (root configs of version 2, 3 and 4: a drop-in of the root's
own version, never newer), CRI-O's drop-in dir, imports as containerd globs them (Go's filepath.Glob: `*` never
crosses `/`), under --root, the TOML a real encoder writes (a character outside the BMP round-trips) and a
symbolic-linked main config written through to its checked target. What the real containerd 2.3.4 makes of
these files: tests/e2e/test_containerd2_cri_live.py."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from devinject.runtimes.config import go_glob, import_covers, read_containerd
from devinject.runtimes.status import runtime_status

CRI_2 = "io.containerd.cri.v1.runtime"
CRI_17 = "io.containerd.grpc.v1.cri"
# containerd 2.3.4's own `config default`, abridged: version 4, its conf.d imported, CDI on by default
DEFAULT_V4 = """version = 4
root = '/var/lib/containerd'
imports = ['{conf_d}/*.toml']

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']
"""
V3 = "version = 3\n# the admin's\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n"
V2 = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"pause:3.9\"\n"


def configure(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(cli, ["runtime", "configure", *args])
    return done.exit_code, done.output


def containerd(config: Path, *args: str, version: str = "2.3.4") -> tuple[int, str]:
    return configure("--runtime", "containerd", "--config", str(config), "--runtime-version", version, *args)


@pytest.mark.parametrize(("root_version", "text", "section"), [
    (2, V2, CRI_17), (3, V3, CRI_2), (4, DEFAULT_V4, CRI_2)])
def test_the_drop_in_is_the_root_configs_own_version(tmp_path: Path, root_version: int, text: str, section: str):
    """containerd 2.3.0-2.3.4 refuse to start on a drop-in newer than the root config ("drop-in config version 3
    higher than root config version 2"): the drop-in takes the root's version and that version's key names."""
    config = tmp_path / "config.toml"
    config.write_text(text.format(conf_d=tmp_path / "conf.d"))
    before = config.read_bytes()
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert code == 0, out
    drop_in = tmp_path / "conf.d/99-devinject.toml"
    data = tomllib.loads(drop_in.read_text())
    assert data == {"version": root_version, "plugins": {section: {"enable_cdi": True, "cdi_spec_dirs": ["/opt/cdi"]}}}
    found = read_containerd(str(config))
    assert found.newer == () and found.cri(True)[:2] == (True, ["/opt/cdi"])
    if root_version == 4:  # its own imports already cover conf.d/*.toml: the root file stays as it was
        assert config.read_bytes() == before
    else:
        assert tomllib.loads(config.read_text())["imports"] == [str(drop_in)]
    written = config.read_bytes(), drop_in.read_bytes()
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert code == 0 and "already configured" in out and (config.read_bytes(), drop_in.read_bytes()) == written
    code, out = containerd(config, "--spec-dir", "/opt/cdi", "--revert")
    assert code == 0 and config.read_bytes() == before and not drop_in.exists()


def test_a_stock_2x_node_without_a_config_already_applies_cdis_default_dirs(tmp_path: Path):
    config = tmp_path / "config.toml"
    code, out = containerd(config)
    assert code == 0 and "already configured" in out and list(tmp_path.iterdir()) == []
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert code == 0, out
    assert tomllib.loads(config.read_text()) == {"version": 4, "imports": [str(tmp_path / "conf.d/99-devinject.toml")]}
    assert tomllib.loads((tmp_path / "conf.d/99-devinject.toml").read_text())["version"] == 4
    code, out = containerd(config, "--spec-dir", "/opt/cdi", version="2.1")  # 2.1 reads up to version 3
    assert code == 1 and f"{config}: a version 4 config (containerd 2.3's), which containerd 2.1 does not read" in out


@pytest.mark.parametrize(("text", "version", "says"), [
    (DEFAULT_V4, "1.7", "a version 4 config (containerd 2's), which containerd 1.7 does not read"),
    (V3, "1.7.34", "a version 3 config (containerd 2's), which containerd 1.7.34 does not read"),
    (DEFAULT_V4, "2.2.1", "a version 4 config (containerd 2.3's), which containerd 2.2.1 does not read (up to 3)"),
    ("version = 5\n", "2.3.4", "version 5, which no containerd devinject knows reads (2.3 reads up to 4)"),
    ("root = '/var/lib/containerd'\n", "2.3.4", "a version 1 config (no `version`), which devinject does not edit: "
                                                "migrate it (containerd config migrate)"),
])
def test_a_config_the_version_given_would_refuse_is_one_line_and_nothing_written(tmp_path: Path, text: str,
                                                                                   version: str, says: str):
    config = tmp_path / "config.toml"
    config.write_text(text.format(conf_d=tmp_path / "conf.d"))
    for extra in ((), ("--revert",)):
        code, out = containerd(config, *extra, version=version)
        assert code == 1 and out == f"devinject: error: {config}: {says}; nothing written\n", out
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_runtime_version_is_honoured_for_a_version_2_config(tmp_path: Path):
    """A version 2 file is 1.7's (edited in place) or an upgraded 2.x node's (a version 2 drop-in): the version
    given decides, not the binary on PATH (this machine's is Debian's 1.6)."""
    config = tmp_path / "config.toml"
    config.write_text(V2)
    assert containerd(config, "--spec-dir", "/opt/cdi", version="1.7")[0] == 0
    assert not (tmp_path / "conf.d").exists() and "(added)" in config.read_text()
    assert containerd(config, "--revert", version="1.7")[0] == 0 and config.read_text() == V2
    assert containerd(config, "--spec-dir", "/opt/cdi", version="2.3.4")[0] == 0
    assert tomllib.loads((tmp_path / "conf.d/99-devinject.toml").read_text())["version"] == 2


def test_imports_are_globbed_as_go_does_so_a_star_never_crosses_a_slash(tmp_path: Path):
    """`imports = ['<dir>/*.toml']` does not cover `<dir>/conf.d/99-devinject.toml` (fnmatch's `*` would, and
    the setting never took effect): configure imports the drop-in by name, and then it is in effect."""
    config = tmp_path / "config.toml"
    config.write_text(f"version = 3\nimports = ['{tmp_path}/*.toml']\n")
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert code == 0, out
    drop_in = str(tmp_path / "conf.d/99-devinject.toml")
    assert tomllib.loads(config.read_text())["imports"] == [f"{tmp_path}/*.toml", drop_in]
    assert drop_in in read_containerd(str(config)).files
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert "already configured" in out


@pytest.mark.parametrize("imports", [
    "imports = ['/opt/other/*.toml']  # the admin's note\n",
    "imports = [\n  '/opt/other/*.toml',  # theirs\n  '/opt/more.toml',\n]\n",
])
def test_revert_gives_back_an_imports_line_with_comments_or_several_lines_byte_for_byte(tmp_path: Path,
                                                                                        imports: str):
    config = tmp_path / "config.toml"
    config.write_text(f"version = 3\n{imports}[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'native'\n")
    before = config.read_bytes()
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert code == 0, out
    assert tomllib.loads(config.read_text())["imports"][-1] == str(tmp_path / "conf.d/99-devinject.toml")
    assert containerd(config, "--revert")[0] == 0 and config.read_bytes() == before


def test_go_glob_rules():
    assert import_covers("/etc/containerd/config.toml", "/etc/containerd/conf.d/*.toml",
                         "/etc/containerd/conf.d/99-devinject.toml")
    assert import_covers("/etc/containerd/config.toml", "conf.d/*.toml", "/etc/containerd/conf.d/99-devinject.toml")
    assert not import_covers("/c/config.toml", "/c/*.toml", "/c/conf.d/99-devinject.toml")
    assert not import_covers("/c/config.toml", "/c/*", "/c/conf.d/99-devinject.toml")
    assert import_covers("/c/config.toml", "/c/*/*.toml", "/c/conf.d/99-devinject.toml")
    assert import_covers("/c/config.toml", "/c/conf.d/[0-9]?-*.toml", "/c/conf.d/99-devinject.toml")
    assert not import_covers("/c/config.toml", "/c/conf.d/[^9]*.toml", "/c/conf.d/99-devinject.toml")
    # no `*`: taken literally, as containerd's resolveImports does
    assert not import_covers("/c/config.toml", "/c/conf.d/9?-devinject.toml", "/c/conf.d/99-devinject.toml")
    assert import_covers("/c/config.toml", "/c/conf.d/../conf.d/99-devinject.toml", "/c/conf.d/99-devinject.toml")


def test_go_glob_lists_dot_files_sorted_and_under_a_root(tmp_path: Path):
    (tmp_path / "etc/conf.d/sub").mkdir(parents=True)
    for name in ("b.toml", ".a.toml", "a.toml", "sub/c.toml"):
        (tmp_path / "etc/conf.d" / name).write_text("")
    assert go_glob("/etc/conf.d/*.toml", str(tmp_path)) == ["/etc/conf.d/.a.toml", "/etc/conf.d/a.toml",
                                                            "/etc/conf.d/b.toml"]
    assert go_glob("/etc/*/*/*.toml", str(tmp_path)) == ["/etc/conf.d/sub/c.toml"]


def test_under_root_an_absolute_import_is_the_roots(tmp_path: Path):
    """configure and doctor read /etc/containerd/conf.d/*.toml of the host under --root, never this machine's."""
    root = tmp_path / "host"
    (root / "etc/containerd/conf.d").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text(DEFAULT_V4.format(conf_d="/etc/containerd/conf.d"))
    (root / "etc/containerd/conf.d/50-admin.toml").write_text(
        "version = 4\n[plugins.'io.containerd.cri.v1.runtime']\n  cdi_spec_dirs = ['/opt/vendor/cdi']\n")
    status = runtime_status(str(root), "containerd", version="2.3.4")
    assert status.spec_dirs == ("/opt/vendor/cdi",) and "50-admin.toml" in status.detail
    code, out = configure("--runtime", "containerd", "--root", str(root), "--runtime-version", "2.3.4",
                          "--spec-dir", "/var/run/cdi")
    assert code == 0, out
    assert (root / "etc/containerd/conf.d/99-devinject.toml").exists()
    assert runtime_status(str(root), "containerd", version="2.3.4").spec_dirs == ("/var/run/cdi",)


def test_a_later_drop_in_that_overrides_devinjects_is_named_and_nothing_written(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text(DEFAULT_V4.format(conf_d=tmp_path / "conf.d"))
    (tmp_path / "conf.d").mkdir()
    late = tmp_path / "conf.d/zz-admin.toml"
    late.write_text("version = 4\n[plugins.'io.containerd.cri.v1.runtime']\n  cdi_spec_dirs = ['/opt/x']\n")
    code, out = containerd(config, "--spec-dir", "/opt/cdi")
    assert code == 1 and out.startswith(f"devinject: error: {late}: sets cdi_spec_dirs after ") and \
        len(out.splitlines()) == 1
    assert [p.name for p in (tmp_path / "conf.d").iterdir()] == ["zz-admin.toml"]


def test_crio_drop_in_goes_to_its_config_dir_whatever_config_says(tmp_path: Path):
    """CRI-O reads drop-ins from its --config-dir (default /etc/crio/crio.conf.d), not dirname(--config)."""
    root = tmp_path / "host"
    (root / "opt/crio").mkdir(parents=True)
    (root / "opt/crio/crio.conf").write_text("[crio.runtime]\ncgroup_manager = 'cgroupfs'\n")
    code, out = configure("--runtime", "crio", "--root", str(root), "--config", "/opt/crio/crio.conf",
                          "--spec-dir", "/var/run/cdi")
    assert code == 0, out
    drop_in = root / "etc/crio/crio.conf.d/99-devinject.conf"
    assert tomllib.loads(drop_in.read_text()) == {"crio": {"runtime": {"cdi_spec_dirs": ["/var/run/cdi"]}}}
    assert not (root / "opt/crio/crio.conf.d").exists()
    assert runtime_status(str(root), "crio").spec_dirs == ("/var/run/cdi",)
    code, out = configure("--runtime", "crio", "--root", str(root), "--config-dir", "/opt/crio/d", "--spec-dir", "/x")
    assert code == 0 and (root / "opt/crio/d/99-devinject.conf").exists()
    code, out = configure("--runtime", "containerd", "--config-dir", "/x")
    assert code == 2 and "only with --runtime crio" in out


def test_a_later_crio_drop_in_of_any_name_that_overrides_devinjects_is_named(tmp_path: Path):
    """CRI-O reads every file of its config dir in name order, `.conf` or not (1.36.3's `crio config`)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d/zz-admin").write_text("[crio.runtime]\ncdi_spec_dirs = ['/opt/x']\n")
    code, out = configure("--runtime", "crio", "--config", str(tmp_path / "crio.conf"), "--config-dir",
                          str(tmp_path / "d"), "--spec-dir", "/opt/cdi")
    assert code == 1 and out.startswith(f"devinject: error: {tmp_path}/d/zz-admin: sets cdi_spec_dirs after "), out
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["zz-admin"]


# ---- issue 40 item 6: TOML written by a real encoder, symbolic-linked configs ----------------------------

NON_BMP = "/opt/cdi-\U0001f680"  # json.dumps writes it as "\ud83d\ude80", a surrogate pair TOML rejects


@pytest.mark.parametrize(("runtime", "text", "version"), [
    ("containerd", V2, "1.7"), ("containerd", V3, "2.1"), ("crio", "[crio.runtime]\n", None),
    ("podman", "[engine]\n", None)])
def test_a_spec_dir_outside_the_bmp_round_trips(tmp_path: Path, runtime: str, text: str, version: str | None):
    config = tmp_path / "main.conf"
    config.write_text(text)
    args = ["--runtime", runtime, "--config", str(config), "--spec-dir", NON_BMP]
    args += ["--runtime-version", version] if version else []
    args += ["--config-dir", str(tmp_path / "crio.conf.d")] if runtime == "crio" else []
    code, out = configure(*args)
    assert code == 0, out
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all("\\ud83d" not in p.read_text() for p in written)
    if runtime == "containerd":
        found = read_containerd(str(config))
        assert found.cri(version != "1.7")[:2] == (True, [NON_BMP])
    else:
        (drop_in,) = [p for p in written if p != config]
        assert NON_BMP in str(tomllib.loads(drop_in.read_text()))


def test_a_symlinked_main_config_is_written_through_to_its_target(tmp_path: Path):
    target = tmp_path / "managed/config.toml"
    target.parent.mkdir()
    target.write_text(V2)
    link = tmp_path / "config.toml"
    link.symlink_to(target)
    code, out = containerd(link, "--spec-dir", "/opt/cdi", version="1.7")
    assert code == 0 and f"wrote {target}" in out, out
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert tomllib.loads(target.read_text())["plugins"][CRI_17]["cdi_spec_dirs"] == ["/opt/cdi"]
    assert containerd(link, "--revert", version="1.7")[0] == 0 and link.is_symlink() and target.read_text() == V2


def test_a_symlinked_config_under_root_resolves_inside_the_root(tmp_path: Path):
    root = tmp_path / "host"
    (root / "etc/containerd").mkdir(parents=True)
    (root / "srv").mkdir()
    (root / "srv/containerd.toml").write_text(V2)
    (root / "etc/containerd/config.toml").symlink_to("/srv/containerd.toml")  # absolute: the host's /srv
    code, out = configure("--runtime", "containerd", "--root", str(root), "--runtime-version", "1.7",
                          "--spec-dir", "/opt/cdi")
    assert code == 0 and f"wrote {root}/srv/containerd.toml" in out, out
    (root / "etc/containerd/config.toml").unlink()
    (root / "etc/containerd/config.toml").symlink_to("../../../outside.toml")
    (tmp_path / "outside.toml").write_text(V2)
    code, out = configure("--runtime", "containerd", "--root", str(root), "--runtime-version", "1.7")
    assert code == 1 and f"which leads out of {root}" in out and (tmp_path / "outside.toml").read_text() == V2


@pytest.mark.parametrize(("make", "why"), [
    (lambda t: os.chown(t, 1000, 1000), "is owned by uid 1000, not root"),
    (lambda t: os.chmod(t, 0o666), "is writable by group or others (mode 0666)"),
    (lambda t: t.unlink(), "leads to nothing"),
])
def test_a_symlinked_config_whose_target_is_not_roots_is_refused(tmp_path: Path, make, why: str):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0 and "uid" in why:
        pytest.skip("chown needs root")
    target = tmp_path / "config.target"
    target.write_text(V2)
    link = tmp_path / "config.toml"
    link.symlink_to(target)
    make(target)
    code, out = containerd(link, "--spec-dir", "/opt/cdi", version="1.7")
    assert code == 1 and out == f"devinject: error: {link}: a symbolic link to {target}, which {why}; nothing " \
                                "written\n", out
    assert link.is_symlink() and (not target.exists() or target.read_text() == V2)
    assert not (tmp_path / "conf.d").exists()
