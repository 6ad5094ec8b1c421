"""`devinject runtime configure`: CDI turned on per runtime, idempotent, an admin's settings and comments kept,
taken back by --revert to the same bytes, a malformed file one line and nothing written."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from devinject.runtimes.config import annotations_passed_through, containerd_config, containerd_cri

ADMIN_17 = """\
# the admin's own comment
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"  # pinned
    enable_cdi = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
"""


def configure(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(cli, ["runtime", "configure", *args])
    return done.exit_code, done.output


def test_containerd_17_is_edited_in_place_keeping_everything(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text(ADMIN_17)
    code, out = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "1.7")
    assert code == 0, out
    text = config.read_text()
    data = tomllib.loads(text)
    cri = data["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.9" and cri["containerd"]["snapshotter"] == "overlayfs"
    assert "# the admin's own comment" in text and "# pinned" in text
    assert not (tmp_path / "conf.d").exists()  # 1.x replaces a whole imported plugin table: no drop-in
    assert containerd_cri(containerd_config(str(config))[0]) == (True, ["/etc/cdi", "/var/run/cdi"])
    # idempotent
    code, out = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "1.7")
    assert code == 0 and "already configured" in out and config.read_text() == text
    # revert: the same bytes as before
    code, out = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "1.7", "--revert")
    assert code == 0 and config.read_text() == ADMIN_17


def test_containerd_17_from_no_config(tmp_path: Path):
    config = tmp_path / "config.toml"
    code, _ = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "1.7.34")
    assert code == 0
    data = tomllib.loads(config.read_text())
    assert data["version"] == 2 and data["plugins"]["io.containerd.grpc.v1.cri"]["enable_cdi"] is True
    configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "1.7", "--revert")
    assert tomllib.loads(config.read_text()) == {"version": 2}


def test_containerd_2_gets_a_drop_in_and_an_import(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text("version = 3\n# keep me\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n")
    before = config.read_text()
    code, out = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "2.1",
                          "--spec-dir", "/var/run/cdi")
    assert code == 0, out
    drop_in = tmp_path / "conf.d" / "99-devinject.toml"
    data = tomllib.loads(drop_in.read_text())
    assert data["version"] == 3
    assert data["plugins"]["io.containerd.cri.v1.runtime"] == {"enable_cdi": True, "cdi_spec_dirs": ["/var/run/cdi"]}
    main = tomllib.loads(config.read_text())
    assert main["imports"] == [str(drop_in)] and main["plugins"]["io.containerd.cri.v1.images"]
    assert "# keep me" in config.read_text()
    assert containerd_cri(containerd_config(str(config))[0])[0] is True
    code, out = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "2.1",
                          "--spec-dir", "/var/run/cdi")
    assert code == 0 and "already configured" in out
    code, _ = configure("--runtime", "containerd", "--config", str(config), "--runtime-version", "2.1", "--revert")
    assert code == 0 and not drop_in.exists() and config.read_text() == before


def test_containerd_16_and_runc_are_pointed_at_the_hook(tmp_path: Path):
    code, out = configure("--runtime", "containerd", "--config", str(tmp_path / "c.toml"),
                          "--runtime-version", "1.6.20")
    assert code == 1 and "applies no CDI" in out and "install-hook" in out and len(out.splitlines()) == 1
    code, out = configure("--runtime", "runc")
    assert code == 1 and "install-hook" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("runtime", "name", "bad"), [
    ("containerd", "config.toml", "version = 2\n[plugins\n"),
    ("docker", "daemon.json", '{"log-driver": "json-file",}'),
    ("crio", "crio.conf", "[crio.runtime\n"),
    ("podman", "containers.conf", "[engine]\ncdi_spec_dirs = [\n"),
])
def test_a_malformed_file_is_one_line_and_nothing_is_written(tmp_path: Path, runtime: str, name: str, bad: str):
    config = tmp_path / name
    config.write_text(bad)
    code, out = configure("--runtime", runtime, "--config", str(config), "--runtime-version", "2.0" if
                          runtime == "containerd" else "27.0")
    assert code == 1 and out.startswith(f"devinject: error: {config}") and len(out.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == [name] and config.read_text() == bad


def test_docker_keeps_other_keys_and_reverts(tmp_path: Path):
    config = tmp_path / "daemon.json"
    config.write_text(json.dumps({"log-driver": "journald", "features": {"buildkit": True}}))
    code, _ = configure("--runtime", "docker", "--config", str(config), "--runtime-version", "27.5")
    assert code == 0
    assert json.loads(config.read_text()) == {"log-driver": "journald", "features": {"buildkit": True, "cdi": True}}
    code, out = configure("--runtime", "docker", "--config", str(config), "--runtime-version", "27.5")
    assert "already configured" in out
    configure("--runtime", "docker", "--config", str(config), "--runtime-version", "27.5", "--revert")
    assert json.loads(config.read_text()) == {"log-driver": "journald", "features": {"buildkit": True}}
    code, out = configure("--runtime", "docker", "--config", str(config), "--runtime-version", "24.0")
    assert code == 1 and "features.cdi came in 25" in out


@pytest.mark.parametrize(("runtime", "main", "drop_in", "section"), [
    ("crio", "crio.conf", "crio.conf.d/99-devinject.conf", ("crio", "runtime")),
    ("podman", "containers.conf", "containers.conf.d/99-devinject.conf", ("engine",)),
])
def test_drop_in_runtimes(tmp_path: Path, runtime: str, main: str, drop_in: str, section: tuple[str, ...]):
    (tmp_path / main).write_text("# admin\n")
    code, _ = configure("--runtime", runtime, "--config", str(tmp_path / main), "--spec-dir", "/etc/cdi",
                        *(["--config-dir", str(tmp_path / "crio.conf.d")] if runtime == "crio" else []))
    assert code == 0
    data = tomllib.loads((tmp_path / drop_in).read_text())
    for key in section:
        data = data[key]
    assert data == {"cdi_spec_dirs": ["/etc/cdi"]}
    assert (tmp_path / main).read_text() == "# admin\n"
    dir_args = ["--config-dir", str(tmp_path / "crio.conf.d")] if runtime == "crio" else []
    code, out = configure("--runtime", runtime, "--config", str(tmp_path / main), "--spec-dir", "/etc/cdi", "--dry-run",
                          "--revert", *dir_args)
    assert code == 0 and out.startswith("---") and (tmp_path / drop_in).exists()
    configure("--runtime", runtime, "--config", str(tmp_path / main), "--spec-dir", "/etc/cdi", "--revert", *dir_args)
    assert not (tmp_path / drop_in).exists()


def test_pod_annotations_passed_through_are_found():
    data = tomllib.loads("""version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  pod_annotations = ["cdi.k8s.io/*"]
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]
  pod_annotations = ["io.katacontainers.*"]
""")
    assert annotations_passed_through(data) == ["runc: cdi.k8s.io/*"]
    assert annotations_passed_through(tomllib.loads('version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd'
                                                    '.runtimes.runc]\npod_annotations = ["*"]\n')) == ["runc: *"]
