"""The node hook bundle (install/nodehook.py), built from this venv's interpreter into a temporary host root and
run as a runtime runs a hook: its launcher by absolute path, with nothing in its environment, from a cwd
elsewhere, on a real container state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from devinject import __version__
from devinject.core.errors import DevinjectError
from devinject.hook.plan import BUNDLED_ENTRY
from devinject.install import nodehook
from devinject.install.nodehook import DEFAULT_DIR, LAUNCHER, STAMP, install_node_hook, node_hook_ready
from devinject.linux.ldcache import parse_ldcache
from tests.conftest import HOSTS
from tests.e2e.conftest import DEVINJECT

LIBDIR = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A host with the node hook installed. Tests that need it to be current install their own right before:
    an edit of any devinject module (other work in this checkout) makes the installed one stale."""
    root = tmp_path_factory.mktemp("node")
    installed = install_node_hook(str(root), DEFAULT_DIR)
    assert installed.changed and installed.hook_path == f"{DEFAULT_DIR}/{LAUNCHER}"
    return root


def _bundle(root: Path) -> Path:
    return root / DEFAULT_DIR.lstrip("/")


def _container(tmp_path: Path) -> tuple[Path, Path]:
    """A container's bundle with a real shared library in its rootfs; (state file, rootfs)."""
    rootfs = tmp_path / "container" / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    libdir = rootfs / LIBDIR.lstrip("/")
    libdir.mkdir(parents=True)
    libz = os.path.realpath(f"{LIBDIR}/libz.so.1")
    shutil.copy(libz, libdir / os.path.basename(libz))
    (rootfs.parent / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                                 "bundle": str(rootfs.parent)}))
    return state, rootfs


def _env_i(launcher: Path, *args: str, cwd: Path, stdin: Path | None = None) -> subprocess.CompletedProcess[str]:
    with open(stdin or os.devnull, "rb") as source:
        return subprocess.run(["env", "-i", str(launcher), *args], capture_output=True, text=True, cwd=cwd,
                              stdin=source, timeout=60)


def test_the_launcher_runs_with_an_empty_environment_from_elsewhere(host: Path, tmp_path: Path) -> None:
    done = _env_i(_bundle(host) / LAUNCHER, "--version", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"devinject, version {__version__}\n", "")


def test_the_bundled_cdi_hook_makes_links_and_the_linker_cache_in_a_container(host: Path, tmp_path: Path) -> None:
    state, rootfs = _container(tmp_path)
    real = os.path.basename(os.path.realpath(f"{LIBDIR}/libz.so.1"))
    launcher = _bundle(host) / LAUNCHER
    links = _env_i(launcher, "cdi-hook", "create-symlinks", "--link", f"{real}::{LIBDIR}/libz.so.1", cwd=tmp_path,
                   stdin=state)
    assert links.returncode == 0, links.stderr
    assert os.readlink(rootfs / LIBDIR.lstrip("/") / "libz.so.1") == real
    cache = _env_i(launcher, "cdi-hook", "update-ldcache", "--folder", LIBDIR, cwd=tmp_path, stdin=state)
    assert cache.returncode == 0, cache.stderr
    entries = {e.soname: e.path for e in parse_ldcache((rootfs / "etc/ld.so.cache").read_bytes())}
    assert entries == {"libz.so.1": f"{LIBDIR}/libz.so.1"}
    refused = _env_i(launcher, "list", cwd=tmp_path)
    assert refused.returncode == 2 and "runs only `cdi-hook" in refused.stderr


def test_nothing_from_the_callers_environment_or_cwd_reaches_the_bundled_interpreter(host: Path,
                                                                                     tmp_path: Path) -> None:
    """A hostile environment (PYTHONPATH and a cwd holding a `devinject` package, PYTHONINSPECT,
    PYTHONVERBOSE, LD_LIBRARY_PATH) changes nothing: the interpreter's environment is what the launcher
    sets, read from /proc while the hook waits for its state."""
    evil = tmp_path / "evil"
    (evil / "devinject" / "hook").mkdir(parents=True)
    marker = tmp_path / "marker"
    for module in ("devinject/__init__.py", "devinject/hook/__init__.py", "devinject/hook/bundled.py"):
        (evil / module).write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {"PYTHONPATH": str(evil), "PYTHONINSPECT": "1", "PYTHONVERBOSE": "1", "LD_LIBRARY_PATH": str(evil),
           "PATH": "/usr/bin:/bin"}
    launcher = str(_bundle(host) / LAUNCHER)
    hook = subprocess.Popen([launcher, "cdi-hook", "update-ldcache", "--folder", LIBDIR], cwd=evil, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        loader = str(_bundle(host) / "lib/ld-linux-x86-64.so.2")
        for _ in range(500):
            if os.path.realpath(f"/proc/{hook.pid}/exe") == loader:
                break
            time.sleep(0.01)
        environ = Path(f"/proc/{hook.pid}/environ").read_bytes().split(b"\0")
    finally:
        _, err = hook.communicate(b"{}", timeout=60)
    bundle = str(_bundle(host))
    assert sorted(e for e in environ if e) == [f"PYTHONHOME={bundle}".encode(),
                                               f"PYTHONPATH={bundle}/lib/python3.11/site-packages".encode()]
    assert not marker.exists()
    assert hook.returncode == 1 and err.decode() == "devinject: error: OCI state on stdin: missing or invalid 'id'\n"


def test_only_what_the_cdi_hook_needs_is_in_the_bundle(host: Path) -> None:
    bundle = _bundle(host)
    names = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert {"bin/python3", "lib/ld-linux-x86-64.so.2", "lib/libc.so.6", STAMP} <= names
    # a cdi-hook makes links and a linker cache with no C call: no _ctypes, no libffi to load on its start
    assert not [n for n in names if "_ctypes" in n or "libffi" in n], names
    assert not {n for n in names if n.split("/")[2:3] in (["test"], ["unittest"], ["tkinter"], ["asyncio"])}
    assert not [n for n in names if "/devinject/deviceplugin/" in n or n.endswith("/devinject/cli.py")]
    stamp = json.loads((bundle / STAMP).read_text())
    assert stamp["version"] == __version__ and stamp["bytes"] < 16 * 2**20  # measured: 10.8 MiB
    assert nodehook.content_digest(str(bundle)) == (stamp["content"], stamp["files"], stamp["bytes"])


def test_node_hook_ready_says_why_not(tmp_path: Path) -> None:
    assert "no node hook installed" in str(node_hook_ready(str(tmp_path), DEFAULT_DIR))
    copy = tmp_path / "copy"
    install_node_hook(str(copy), DEFAULT_DIR)
    assert node_hook_ready(str(copy), DEFAULT_DIR) is None
    stamp_path = _bundle(copy) / STAMP
    stamp = json.loads(stamp_path.read_text())
    stamp_path.write_text(json.dumps({**stamp, "version": "0.0.1"}))
    assert "stale: devinject 0.0.1's node hook" in str(node_hook_ready(str(copy), DEFAULT_DIR))
    sources = {**stamp["sources"], "bin/python3": [stamp["sources"]["bin/python3"][0], "0" * 64]}
    stamp_path.write_text(json.dumps({**stamp, "sources": sources}))  # as when the agent's image has another python
    assert "stale: bin/python3 was copied from this agent's" in str(node_hook_ready(str(copy), DEFAULT_DIR))
    stamp_path.write_text(json.dumps(stamp))
    with open(_bundle(copy) / "lib/python3.11/os.py", "a") as handle:
        handle.write("\n")
    assert "changed since it was installed" in str(node_hook_ready(str(copy), DEFAULT_DIR))
    stamp_path.unlink()
    assert "no devinject-node-hook.json" in str(node_hook_ready(str(copy), DEFAULT_DIR))
    os.chmod(_bundle(copy), 0o777)
    assert "writable by group or others" in str(node_hook_ready(str(copy), DEFAULT_DIR))


def test_a_stale_bundle_is_replaced_in_one_step_and_a_current_one_kept(tmp_path: Path) -> None:
    root = str(tmp_path)
    install_node_hook(root, DEFAULT_DIR)
    bundle = _bundle(tmp_path)
    kept = install_node_hook(root, DEFAULT_DIR)
    assert not kept.changed and kept.files > 0
    before = os.stat(bundle).st_ino
    stamp = json.loads((bundle / STAMP).read_text())
    (bundle / STAMP).write_text(json.dumps({**stamp, "version": "0.0.1"}))
    replaced = install_node_hook(root, DEFAULT_DIR)
    assert replaced.changed and os.stat(bundle).st_ino != before
    assert node_hook_ready(root, DEFAULT_DIR) is None
    assert sorted(os.listdir(bundle.parent)) == [".hook.lock", "hook"]  # no stage, no previous bundle left


def test_a_new_bundle_that_does_not_run_leaves_the_installed_one_in_place(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    install_node_hook(root, DEFAULT_DIR)
    bundle = _bundle(tmp_path)
    content = json.loads((bundle / STAMP).read_text())["content"]
    layout = nodehook.layout
    monkeypatch.setattr(nodehook, "layout", lambda measured: {  # a bundle without the encodings package
        rel: src for rel, src in layout(measured).items() if "/encodings/" not in rel})
    with pytest.raises(DevinjectError, match="the new node hook does not run, the installed one is kept"):
        install_node_hook(root, DEFAULT_DIR, force=True)
    assert json.loads((bundle / STAMP).read_text())["content"] == content
    assert node_hook_ready(root, DEFAULT_DIR) is None
    assert sorted(os.listdir(bundle.parent)) == [".hook.lock", "hook"]


def test_install_node_hook_command_prints_the_hook_path_and_generate_names_it(host: Path, tmp_path: Path) -> None:
    install_node_hook(str(host), DEFAULT_DIR)  # current as of now
    done = subprocess.run([DEVINJECT, "install-node-hook", "--host-root", str(host)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{DEFAULT_DIR}/{LAUNCHER}\n" and "already installed and current" in done.stderr
    check = subprocess.run([DEVINJECT, "install-node-hook", "--host-root", str(tmp_path), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and check.stderr.startswith("devinject: error: ") and "no node hook" in check.stderr
    fixture = HOSTS / "hgx-h100"
    fake = tmp_path / "host"
    shutil.copytree(fixture, fake, symlinks=True)
    shutil.copytree(_bundle(host), _bundle(fake), symlinks=True)
    spec = subprocess.run([DEVINJECT, "generate", "--root", str(fake), "--kind", "nvidia.com/gpu", "--output", "-",
                           "--format", "json", "--node-hook", DEFAULT_DIR, "--target-root", "/"],
                          capture_output=True, text=True, timeout=60)
    assert spec.returncode == 0, spec.stderr
    hooks = json.loads(spec.stdout)["containerEdits"]["hooks"]
    # what the launcher runs, named directly: the bundled loader, the interpreter's flags, the launcher's env
    program, argv, env = nodehook.bundle_command(DEFAULT_DIR)
    assert hooks and {(h["path"], tuple(h["args"][:len(argv)]), tuple(h["env"])) for h in hooks} == {
        (program, argv, env)}
    assert program == f"{DEFAULT_DIR}/lib/{nodehook.loader_name()}" and argv[-2:] == ("-c", BUNDLED_ENTRY)
    both = subprocess.run([DEVINJECT, "generate", "--root", str(fake), "--output", "-", "--node-hook", DEFAULT_DIR,
                           "--hook-path", "/usr/bin/devinject"], capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "give one" in both.stderr


def test_what_killed_installs_left_is_removed_under_the_lock(tmp_path: Path) -> None:
    """SIGKILLed `install-node-hook --force` runs left `.hook.new-*` stages and scratch containers (44 MiB after a
    few; an init container at its memory limit would loop and grow them): the next install removes them,
    whether it rebuilds or keeps the bundle, and follows no link."""
    root = str(tmp_path)
    install_node_hook(root, DEFAULT_DIR)
    parent = _bundle(tmp_path).parent
    for left in (".hook.new-k1l2m3", ".devinject-node-hook-check-a1b2c3"):
        (parent / left / "lib").mkdir(parents=True)
        (parent / left / "lib" / "libbig.so").write_bytes(b"\0" * 4096)
    outside = tmp_path / "keep"
    outside.mkdir()
    (outside / "file").write_text("mine")
    (parent / ".hook.new-link").symlink_to(outside)
    kept = install_node_hook(root, DEFAULT_DIR)
    assert not kept.changed
    assert sorted(os.listdir(parent)) == [".hook.lock", ".hook.new-link", "hook"]
    assert (outside / "file").read_text() == "mine"


def test_check_refuses_a_bundle_file_of_another_owner(tmp_path: Path) -> None:
    root = str(tmp_path)
    install_node_hook(root, DEFAULT_DIR)
    assert node_hook_ready(root, DEFAULT_DIR, run=False) is None
    victim = _bundle(tmp_path) / "lib/python3.11/os.py"
    os.chown(victim, 65534, 65534)  # mode and content unchanged: the stamp's hash still matches
    assert f"{victim}: owned by uid 65534" in str(node_hook_ready(root, DEFAULT_DIR, run=False))


def test_a_directory_above_the_bundle_others_can_write_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path)
    install_node_hook(root, DEFAULT_DIR)
    opt = tmp_path / "opt"
    opt.chmod(0o775)  # another user of the group could move /opt/devinject aside and put theirs there
    assert f"{opt}: a directory above the node hook is writable by group or others" in \
        str(node_hook_ready(root, DEFAULT_DIR, run=False))
    with pytest.raises(DevinjectError, match="a directory above the node hook is writable"):
        install_node_hook(root, DEFAULT_DIR, force=True)
    opt.chmod(0o1777)  # sticky: nobody renames what is root's
    assert node_hook_ready(root, DEFAULT_DIR, run=False) is None
