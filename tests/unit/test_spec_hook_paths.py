"""Specs that cannot work are not written, and `validate` says so. Before, `generate` run as a relative
`.venv/bin/devinject` wrote specs whose hook is `/usr/local/bin/devinject`, which did not exist, `validate`
said ok, and podman then failed every container start (`fork/exec ...: no such file or directory`);
`generate --output-dir` into a mode-0777 directory wrote specs the hook and `validate` then refuse."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HOSTS

REPO = Path(__file__).resolve().parents[2]
DEVINJECT = str(Path(sys.executable).parent / "devinject")
GAUDI = str(HOSTS / "gaudi2")


def run(*args: str, cwd: str | None = None, argv0: str = DEVINJECT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([argv0, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_a_relative_devinject_names_itself_by_its_absolute_path(tmp_path: Path) -> None:
    relative = os.path.relpath(DEVINJECT, REPO)
    assert not relative.startswith("/")
    done = run("generate", "--root", GAUDI, "--output", "-", cwd=str(REPO), argv0=relative)
    assert done.returncode == 0, done.stderr
    # this installation's own program by its absolute path: its interpreter on the hook launcher (-IS), as
    # generate names the hooks by default (specs/generate.hook_command), never a guessed /usr/local/bin/devinject
    launcher = str(REPO / "src" / "devinject" / "hook" / "launcher.py")
    assert f"path: {sys.executable}\n" in done.stdout and f"- {launcher}\n" in done.stdout, done.stdout
    assert "/usr/local/bin/devinject" not in done.stdout


@pytest.mark.parametrize(("hook", "says"), [
    ("/usr/local/bin/devinject-nowhere", "no such file or directory on this host"),
    ("bin/devinject", "must be an absolute path"),
    ("/etc/hostname", "not an executable file"),
])
def test_generate_refuses_a_hook_the_runtime_cannot_run(tmp_path: Path, hook: str, says: str) -> None:
    host = tmp_path / "host"
    shutil.copytree(GAUDI, host, symlinks=True)
    (host / "etc").mkdir(exist_ok=True)
    (host / "etc" / "hostname").write_text("node\n")
    out = tmp_path / "cdi"
    # --target-root /: the specs are for the host whose / this process sees at --root (a pod's /host)
    done = run("generate", "--root", str(host), "--target-root", "/", "--hook-path", hook, "--output-dir", str(out))
    assert done.returncode != 0 and says in done.stderr and "nothing written" in done.stderr, done.stderr
    assert not out.exists()


def test_generate_refuses_a_spec_dir_others_can_write(tmp_path: Path) -> None:
    out = tmp_path / "cdi"
    out.mkdir()
    out.chmod(0o777)
    done = run("generate", "--root", GAUDI, "--hook-path", "/bin/true", "--output-dir", str(out))
    assert done.returncode != 0 and "writable by group or others" in done.stderr, done.stderr
    assert list(out.iterdir()) == []
    file_out = out / "gaudi.yaml"
    done = run("generate", "--root", GAUDI, "--hook-path", "/bin/true", "--output", str(file_out))
    assert done.returncode != 0 and not file_out.exists()


def test_validate_refuses_a_spec_whose_hook_does_not_exist_here_as_the_nodes_own(tmp_path: Path) -> None:
    """A hook missing on this machine is a node-local problem: an error with --node (and for the node's own spec
    dirs, `validate` without PATHS), a warning for a file given, which may be made for another node (the CDI
    reference calls it valid: validate in CI refused every spec made for a GPU node)."""
    out = tmp_path / "cdi"
    done = run("generate", "--root", GAUDI, "--hook-path", "/bin/true", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr
    assert run("validate", "--node", str(out)).returncode == 0
    spec = out / "habana.ai-gaudi.yaml"
    spec.write_text(spec.read_text().replace("path: /bin/true", "path: /usr/local/bin/devinject-nowhere"))
    problem = "containerEdits.hooks[0].path: /usr/local/bin/devinject-nowhere: no such file or directory on this host"
    done = run("validate", "--node", str(out))
    assert done.returncode != 0 and problem in done.stderr and "warning" not in done.stderr, done.stderr
    done = run("validate", str(out))
    assert done.returncode == 0 and f"warning: {spec}: {problem}" in done.stderr, done.stderr
    assert done.stdout == f"ok: {spec}\n"
