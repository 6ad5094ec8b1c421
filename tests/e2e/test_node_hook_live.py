"""The node hook on a runtime that applies CDI itself (podman 4.3 on runc runs a spec's createContainer hooks
on the host): the hook path the node agent writes into its specs must name a devinject the host can run.
The agent lives in its image, so `install-node-hook` puts a self-contained one on the host; issue 19 saw
every GPU pod fail with `error running hook #0: fork/exec /usr/local/bin/devinject: no such file or
directory` without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from devinject.install.nodehook import DEFAULT_DIR, hook_path, loader_name
from devinject.linux.ldcache import parse_ldcache
from tests.e2e.conftest import DEVINJECT, PODMAN, REPO, in_cdi_dir, require

pytestmark = pytest.mark.live

LIBDIR = "/usr/lib/x86_64-linux-gnu"
SCRIPT = f"readlink {LIBDIR}/libcuda.so.1; echo ---; cat /etc/ld.so.cache"


def _python_places() -> list[str]:
    """Every directory an interpreter or its packages could come from on this machine: the venv, this
    checkout's sources, the system's and pyenv's Pythons."""
    venv = Path(sys.prefix)
    places = [str(venv), str(REPO / "src"), "/usr/lib/python3", "/usr/local/lib/python3.11", "/root/.pyenv",
              *sorted(str(p) for p in Path("/usr/lib").glob("python3*"))]
    return [p for p in dict.fromkeys(places) if os.path.isdir(p)]


def _without_python(command: list[str]) -> list[str]:
    """`command` in a private mount namespace where no Python is reachable: an empty tmpfs over every place
    one lives, /dev/null over every interpreter binary; the script fails if any is still there."""
    binaries = [str(p) for p in Path("/usr/bin").glob("python3*") if p.is_file() and not p.is_symlink()]
    hide = [f"mount -t tmpfs -o mode=0755 devinject-hidden {p}" for p in _python_places()]
    hide += [f"mount --bind /dev/null {b}" for b in binaries]
    stdlib = os.path.dirname(os.__file__)
    checks = [f"! test -e {sys.prefix}/bin/python3", f"! test -e {stdlib}/os.py", *(f"! test -s {b}" for b in binaries)]
    script = " && ".join([*hide, *checks, 'exec "$@"'])
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *command]


@pytest.fixture(scope="module")
def node_hook(live_host: Path) -> str:
    """The node hook installed on the live host (its / is `live_host`, as /host is the agent pod's): the
    launcher's path as this machine's runtime sees it."""
    done = subprocess.run([DEVINJECT, "install-node-hook", "--host-root", str(live_host)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hook_path(DEFAULT_DIR)
    return str(live_host) + hook_path(DEFAULT_DIR)


def _spec(live_host: Path, out: Path, *hook_args: str) -> Path:
    spec = out / "nvidia.com-gpu.yaml"
    done = subprocess.run([DEVINJECT, "generate", "--root", str(live_host), "--kind", "nvidia.com/gpu", "--output",
                           str(spec), *hook_args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return spec


def _run_gpu_container(image: str, spec: Path, *, hide_python: bool) -> subprocess.CompletedProcess[bytes]:
    command = [*PODMAN, "--device", "nvidia.com/gpu=0", image, "sh", "-c", SCRIPT]
    with in_cdi_dir(spec):
        return subprocess.run(_without_python(command) if hide_python else command, capture_output=True,
                              timeout=180)


@pytest.mark.parametrize("named", ["--node-hook", "--hook-path"])
def test_a_spec_naming_the_installed_node_hook_starts_on_podman_with_no_python_on_the_node(
        image: str, live_host: Path, node_hook: str, tmp_path: Path, named: str) -> None:
    """`--node-hook DIR` names what the bundle's launcher runs (its loader, the interpreter, the hook's env),
    without the launcher's /bin/sh; a `--hook-path` of the launcher runs the launcher."""
    spec = _spec(live_host, tmp_path, *(("--node-hook", DEFAULT_DIR) if named == "--node-hook" else
                                        ("--hook-path", node_hook)))
    hooks = yaml.safe_load(spec.read_text())["containerEdits"]["hooks"]
    bundle = node_hook.removesuffix("/bin/devinject")
    assert "/.venv/" not in spec.read_text()  # every CDI hook is the bundle's
    if named == "--node-hook":
        site = f"{bundle}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
        assert {(h["path"], tuple(h["env"])) for h in hooks} == {
            (f"{bundle}/lib/{loader_name()}", (f"PYTHONHOME={bundle}", f"PYTHONPATH={site}"))}
    else:
        assert {h["path"] for h in hooks} == {node_hook}
    done = _run_gpu_container(image, spec, hide_python=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    link, _, cache = done.stdout.partition(b"\n---\n")
    assert link == b"libcuda.so.550.54.14"  # the SONAME link, made by the bundle's create-symlinks
    entries = {e.soname: e.path for e in parse_ldcache(cache)}  # the linker cache, by its update-ldcache
    assert entries["libcuda.so.1"] == f"{LIBDIR}/libcuda.so.1"


def test_the_hidden_places_really_hold_the_python_the_agent_runs(live_host: Path, node_hook: str) -> None:
    """The namespace above is what it claims: the agent's own interpreter does not start there, while the
    bundle's launcher does (from a cwd elsewhere, with nothing in its environment)."""
    require(shutil.which("unshare") is not None, "unshare (util-linux) not installed")
    agent = subprocess.run(_without_python([sys.executable, "-c", "print('ran')"]), capture_output=True, text=True,
                           timeout=60)
    assert "ran" not in agent.stdout and agent.returncode != 0
    bundle = subprocess.run(_without_python(["env", "-i", node_hook, "--version"]), capture_output=True, text=True,
                            timeout=60, cwd="/")
    assert bundle.returncode == 0, bundle.stderr
    assert bundle.stdout.startswith("devinject, version ")


def test_a_hook_path_the_node_does_not_have_fails_every_gpu_container(image: str, live_host: Path,
                                                                      tmp_path: Path) -> None:
    """What the DaemonSet wrote before (`--hook-path=/usr/local/bin/devinject`, a path of the agent's
    image): the runtime cannot run the hook and the container does not start."""
    missing = "/usr/local/bin/devinject"
    if os.path.lexists(missing):
        missing = str(tmp_path / "usr/local/bin/devinject")
    done = _run_gpu_container(image, _spec(live_host, tmp_path, "--hook-path", missing), hide_python=False)
    assert done.returncode != 0
    assert f"error running hook #0: fork/exec {missing}: no such file or directory" in done.stderr.decode()


def test_generate_writes_no_spec_for_a_node_hook_that_is_not_there(live_host: Path, tmp_path: Path) -> None:
    out = tmp_path / "cdi"
    done = subprocess.run([DEVINJECT, "generate", "--root", str(live_host), "--output-dir", str(out),
                           "--node-hook", "/opt/devinject/missing"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("devinject: error: --node-hook /opt/devinject/missing: ")
    assert "no node hook installed" in done.stderr and len(done.stderr.splitlines()) == 1
    assert not out.exists()
