"""The node hook: a self-contained devinject that the node agent installs onto the host, so that the CDI hooks
its specs name (`cdi-hook create-symlinks`, `update-ldcache`) run where a runtime that applies CDI itself
(containerd >= 1.7, CRI-O, podman) runs them: on the host, where the agent's image is not.

The bundle (`<dir>`, by default /opt/devinject/hook) holds the agent's own interpreter (`bin/python3`), its
ELF loader and the shared libraries it maps (`lib/`), the part of the standard library the cdi-hook path imports and the
devinject modules it imports (`lib/pythonX.Y/`, compiled), a `/bin/sh` launcher (`bin/devinject`) and a
stamp (`devinject-node-hook.json`: devinject's version, what it was built from, a hash of the rest). The
launcher runs the interpreter through the bundled loader with the bundled libraries only, in a clean
environment, so the node needs nothing but `/bin/sh` and its kernel — the kernel the agent's pod runs on.

What goes in is measured, not listed: the agent's interpreter runs the cdi-hook's own commands (in a scratch
container state) and reports its modules and the files the loader mapped (/proc/self/maps); the loader's
own resolution of DT_NEEDED, read back, with each library named by the SONAME read from its ELF header.
Nothing from anywhere else is executed. A staged bundle is run (`--version` and both cdi-hook commands)
before it replaces the installed one; the replacement is one renameat2(RENAME_EXCHANGE) of two sibling
directories, the previous bundle removed only once the new one is in place.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devinject import __version__
from devinject.core.errors import DevinjectError
from devinject.hook.plan import BUNDLED_ENTRY
from devinject.specs.hooks import HookCommand

DEFAULT_DIR = "/opt/devinject/hook"  # its parent is devinject's alone: the DaemonSet mounts only that
LAUNCHER = "bin/devinject"
STAMP = "devinject-node-hook.json"
RUN_TIMEOUT = 30.0  # one run of the bundle's launcher (an interpreter's start and a cdi-hook)
LOCK_TIMEOUT = 60.0
_PT_INTERP = 3
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_PY = f"python{sys.version_info[0]}.{sys.version_info[1]}"
_SITE = f"lib/{_PY}/site-packages"

# The cdi-hook commands the probe runs in the agent's interpreter (to measure what they import) and the staged
# bundle runs before it is installed (to prove it works), against a scratch container state.
_SCENARIOS = (
    ("cdi-hook", "create-symlinks", "--link", "libdevinject-probe.so.1.0::/usr/lib/libdevinject-probe.so.1"),
    ("cdi-hook", "update-ldcache", "--folder", "/usr/lib", "--forward-compat", "/usr/lib/compat:libprobe.so.1:1.0"),
    ("cdi-hook", "create-symlinks", "--link", "bad"),  # an error's path imports what errors need
    ("cdi-hook", "links-and-ldcache", "--link", "libdevinject-probe.so.1.0::/usr/lib/libdevinject-probe.so.1",
     "--folder", "/usr/lib"),  # what specs name when they need both: one process
    ("cdi-hook", "create-symlinks", "--device-link", "../card0::/dev/dri/by-path/pci-probe-card"),  # no such device
    ("cdi-hook", "--help"),
    ("--version",),
)
_SCENARIO_OK = (0, 0, 1, 0, 0, 0, 0)

_PROBE = r"""
import os, sys
package_parent, scratch, scenarios = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, package_parent)
from devinject.hook.bundled import main
status = []
null = os.open(os.devnull, os.O_WRONLY)
saved = os.dup(1), os.dup(2)
for scenario in scenarios:
    fd = os.open(scratch + "/state.json", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        status.append(main(scenario.split("\x1f")))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
modules = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
with open("/proc/self/maps") as maps:
    mapped = sorted({line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6})
import json
print(json.dumps({"status": status, "modules": modules, "mapped": mapped}))
"""


@dataclass(frozen=True, slots=True)
class Installed:
    hook_path: str  # the launcher, as the host names it: the --hook-path for specs
    changed: bool  # False: the bundle in place was already this agent's
    files: int
    size: int  # bytes


def hook_path(directory: str = DEFAULT_DIR) -> str:
    """The launcher of the bundle at `directory` (a host path): what specs name as their CDI hooks' path."""
    return f"{directory.rstrip('/')}/{LAUNCHER}"


def in_root(host_root: str, directory: str) -> str:
    """`directory` (absolute, as the host names it) under `host_root` (where this process sees the host's /)."""
    if not directory.startswith("/") or ".." in directory.split("/"):
        raise DevinjectError(f"--dir {directory!r}: must be an absolute path without '..'")
    if directory.rstrip("/") == "":
        raise DevinjectError("--dir /: the node hook needs a directory of its own")
    return os.path.normpath(f"{host_root.rstrip('/')}/{directory.strip('/')}")


# -- what goes in ------------------------------------------------------------------------------------------------


def interpreter() -> str:
    """The agent's own interpreter, every link resolved (a virtual environment's python is a link to it)."""
    return os.path.realpath(sys.executable)


def program_interpreter(path: str) -> str:
    """The ELF loader an executable asks for (PT_INTERP), read from its program headers."""
    with open(path, "rb") as handle:
        head = handle.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise DevinjectError(f"{path}: not a 64-bit little-endian ELF executable")
        (phoff,) = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        handle.seek(phoff)
        table = handle.read(phentsize * min(phnum, 128))
        for index in range(len(table) // phentsize):
            p_type, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, index * phentsize)
            if p_type == _PT_INTERP and 0 < filesz < 4096:
                handle.seek(offset)
                return handle.read(filesz).rstrip(b"\0").decode()
    raise DevinjectError(f"{path}: no program interpreter (a static or not an executable)")


def _soname(path: str) -> str | None:
    from devinject.linux.elfinfo import read_shared_object

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        found = read_shared_object(fd)
    finally:
        os.close(fd)
    return found.soname if found else None


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"\x7fELF"
    except OSError:
        return False


def _scratch_state(directory: str) -> str:
    """A container's bundle for the cdi-hook commands: config.json, a rootfs with /etc and /usr/lib, the OCI
    state on stdin in state.json. Returns the directory."""
    scratch = tempfile.mkdtemp(prefix=".devinject-node-hook-check-", dir=directory)
    for sub in ("rootfs/etc", "rootfs/usr/lib/compat"):
        os.makedirs(f"{scratch}/{sub}")
    Path(scratch, "config.json").write_text('{"ociVersion": "1.0.2", "root": {"path": "rootfs"}}')
    Path(scratch, "state.json").write_text(json.dumps({"ociVersion": "1.0.2", "id": "devinject-node-hook-check",
                                                       "status": "creating", "pid": 0, "bundle": scratch}))
    return scratch


def _check_scenario_results(scratch: str, statuses: list[int], who: str) -> None:
    if tuple(statuses) != _SCENARIO_OK:
        raise DevinjectError(f"{who}: the cdi-hook commands exited {statuses}, expected {list(_SCENARIO_OK)}")
    link = f"{scratch}/rootfs/usr/lib/libdevinject-probe.so.1"
    if not os.path.islink(link) or not os.path.isfile(f"{scratch}/rootfs/etc/ld.so.cache"):
        raise DevinjectError(f"{who}: cdi-hook made no SONAME link or linker cache in a container's rootfs")


@dataclass(frozen=True, slots=True)
class _Measured:
    modules: dict[str, str]  # module name -> its file, for modules loaded from a file
    mapped: list[str]  # ELF files the loader mapped


def measure(work_dir: str) -> _Measured:
    """Run the cdi-hook's commands in the agent's interpreter (isolated, no site, clean environment) and
    report what they imported and what the loader mapped."""
    import devinject

    scratch = _scratch_state(work_dir)
    try:
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(devinject.__file__)))
        done = subprocess.run([interpreter(), "-I", "-S", "-B", "-c", _PROBE, package_parent, scratch,
                               *("\x1f".join(s) for s in _SCENARIOS)], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT, env={}, cwd=scratch, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise DevinjectError(f"{interpreter()}: measuring the cdi-hook's imports failed: {said[0]}")
        report = json.loads(done.stdout)
        _check_scenario_results(scratch, report["status"], f"{interpreter()} (this agent)")
    except subprocess.TimeoutExpired:
        raise DevinjectError(f"{interpreter()}: measuring the cdi-hook's imports took over {RUN_TIMEOUT:g} s") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    modules = {name: path for name, path in report["modules"].items() if path}
    return _Measured(modules, [p for p in report["mapped"] if p.startswith("/") and _is_elf(p)])


def layout(measured: _Measured) -> dict[str, str]:
    """The bundle's files: relative path -> the file it is copied from."""
    import sysconfig

    import devinject

    exe = interpreter()
    loader = os.path.realpath(program_interpreter(exe))
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    package_parent = os.path.realpath(os.path.dirname(os.path.dirname(devinject.__file__)))
    files = {"bin/python3": exe, f"lib/{os.path.basename(program_interpreter(exe))}": loader}
    module_files: set[str] = set()
    for name, path in sorted(measured.modules.items()):
        real = os.path.realpath(path)
        if name == "__main__" or real in module_files:
            continue
        if name.split(".")[0] == "devinject":
            files[f"{_SITE}/{os.path.relpath(real, package_parent)}"] = real
        elif real.startswith(stdlib + "/"):
            files[f"lib/{_PY}/{os.path.relpath(real, stdlib)}"] = real
        else:
            raise DevinjectError(f"{path}: module {name} is neither devinject's nor the standard library's "
                                 f"({stdlib}): the node hook cannot carry it")
        module_files.add(real)
    for path in measured.mapped:
        real = os.path.realpath(path)
        if real in (exe, loader) or real in module_files:
            continue
        files[f"lib/{_soname(real) or os.path.basename(real)}"] = real
    if not any(rel.startswith(f"lib/{_PY}/encodings/") for rel in files):
        raise DevinjectError(f"{stdlib}: the interpreter started without the encodings package")
    files[f"lib/{_PY}/os.py"] = os.path.join(stdlib, "os.py")  # the landmark of a standard library
    return files


@functools.cache
def loader_name() -> str:
    """The file name of the ELF loader this agent's interpreter asks for: the bundle's `lib/<it>`."""
    return os.path.basename(program_interpreter(interpreter()))


def bundle_command(directory: str, loader: str | None = None) -> HookCommand:
    """How the bundle at `directory` (as the host names it) runs a cdi-hook: (the program, its argv before
    `cdi-hook`, its environment): the bundled interpreter through the bundled loader, on the bundled libraries
    only, with no `site`, no user site, nothing prepended to its path and no pycs written. The launcher runs
    exactly this; a spec names it itself (`generate --node-hook`), with this environment as the hook's `env`,
    and saves the launcher's /bin/sh (1.3 ms a container start): a runtime gives a hook its spec's `env` and
    nothing else (runc, crun), so there is nothing to unset."""
    lib = f"{directory}/lib"
    program = f"{lib}/{loader or loader_name()}"
    argv = (program, "--inhibit-cache", "--library-path", lib, f"{directory}/bin/python3", "-S", "-s", "-P", "-B",
            "-c", BUNDLED_ENTRY)
    return HookCommand(program, argv, (f"PYTHONHOME={directory}", f"PYTHONPATH={directory}/{_SITE}"))


def launcher_text(loader: str) -> str:
    """The `/bin/sh` launcher: the bundle is where it is (shell parameter expansion of $0 only: the hook path
    must be the launcher itself, not a link to it); every variable it was given is unset (a spec's env, an
    admin's shell: LD_PRELOAD, PYTHONPATH, PYTHONINSPECT... reach neither the loader nor the interpreter), then
    it runs `bundle_command` in that command's environment."""
    _, argv, env = bundle_command("$D", loader)
    words = [f'"{a}"' if "$D" in a else shlex.quote(a) for a in argv]
    names = " ".join(e.partition("=")[0] for e in env)
    assignments = "\n".join(env)
    return f"""#!/bin/sh
# devinject's node hook, written by `devinject install-node-hook`: covered by {STAMP}'s hash, do not edit.
# Runs devinject's own interpreter through its own loader and libraries; needs only /bin/sh and the kernel.
while IFS= read -r line; do
\tcase $line in
\t"export "*) name=${{line#export }} ;;
\t"declare -x "*) name=${{line#declare -x }} ;;
\t*) continue ;;
\tesac
\tcommand unset "${{name%%=*}}" 2>/dev/null
done <<EOF
$(export -p)
EOF
case $0 in
/*/{LAUNCHER}) D=${{0%/{LAUNCHER}}} ;;
*) echo "devinject: error: $0: run the node hook by its absolute path, <bundle>/{LAUNCHER}" >&2; exit 127 ;;
esac
{assignments}
export {names}
exec {" ".join(words[:-2])} \\
\t{" ".join(words[-2:])} "$@"
"""


# -- building, checking, installing ------------------------------------------------------------------------------


def _file_digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def stale_sources(sources: object) -> str | None:
    """The first file the bundle copied (its stamp's `sources`: bundle path -> [this agent's file, its SHA-256
    then]) that this agent no longer has as it was, e.g. after a new image: its interpreter, a library, a
    module the cdi-hook imports. None when every one is unchanged."""
    if not isinstance(sources, dict) or not sources:
        return "its stamp lists no sources"
    for rel, entry in sorted(sources.items()):
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            return f"its stamp's source for {rel} is malformed"
        try:
            if _file_digest(entry[0]) == entry[1]:
                continue
        except OSError:
            pass
        return f"{rel} was copied from this agent's {entry[0]}, which has changed or is gone"
    return None


def content_digest(bundle: str) -> tuple[str, int, int]:
    """A hash of everything in the bundle but its stamp (each path, type, mode and content), with the number
    of files and their bytes."""
    digest = hashlib.sha256()
    files = size = 0
    for top, dirs, names in os.walk(bundle):
        dirs.sort()
        for name in sorted(dirs + names):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, bundle)
            if rel == STAMP:
                continue
            st = os.lstat(path)
            digest.update(f"{rel}\0{st.st_mode:o}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                digest.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as handle:
                    digest.update(hashlib.file_digest(handle, "sha256").digest())
                files, size = files + 1, size + st.st_size
    return digest.hexdigest(), files, size


def build(stage: str, final_dir: str, work_dir: str) -> tuple[int, int]:
    """Fill the empty directory `stage` with the bundle that will live at `final_dir` (the host's path: the
    name compiled modules carry). Returns (files, bytes)."""
    import py_compile

    files = layout(measure(work_dir))
    sources: dict[str, list[str]] = {}
    for rel, source in sorted(files.items()):
        target = os.path.join(stage, rel)
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        shutil.copyfile(source, target)
        sources[rel] = [source, _file_digest(target)]
        executable = rel == "bin/python3" or (rel.startswith("lib/") and _is_elf(source))
        os.chmod(target, 0o755 if executable else 0o644)
        if rel.endswith(".py"):
            import importlib.util

            cache = importlib.util.cache_from_source(target)
            py_compile.compile(target, cfile=cache, dfile=os.path.join(final_dir, rel), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            os.chmod(cache, 0o644)
    launcher = os.path.join(stage, LAUNCHER)
    Path(launcher).write_text(launcher_text(loader_name()))
    os.chmod(launcher, 0o755)
    for top, dirs, _ in os.walk(stage):
        for name in dirs:
            os.chmod(os.path.join(top, name), 0o755)
    os.chmod(stage, 0o755)
    content, count, size = content_digest(stage)
    stamp = {"version": __version__, "content": content, "python": sys.version.split()[0], "files": count,
             "bytes": size, "sources": sources}
    Path(stage, STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    os.chmod(os.path.join(stage, STAMP), 0o644)
    return count, size


def run_launcher(bundle: str, *args: str, stdin: str | None = None, cwd: str = "/") \
        -> subprocess.CompletedProcess[str]:
    """The bundle's launcher, as a runtime runs a hook: by its absolute path, with an empty environment."""
    with open(stdin or os.devnull, "rb") as source:
        return subprocess.run([os.path.join(bundle, LAUNCHER), *args], capture_output=True, text=True, env={},
                              cwd=cwd, stdin=source, timeout=RUN_TIMEOUT, check=False)


def _runs(bundle: str, work_dir: str | None = None) -> str | None:
    """Why the bundle does not run (None when it does): `--version`, and with `work_dir`, the cdi-hook
    commands against a scratch container state there."""
    try:
        done = run_launcher(bundle, "--version")
        if done.returncode != 0 or done.stdout.strip() != f"devinject, version {__version__}":
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit {done.returncode}"]
            return f"{bundle}/{LAUNCHER} --version does not run: {said[0]}"
        if work_dir is None:
            return None
        scratch = _scratch_state(work_dir)
        try:
            statuses = [run_launcher(bundle, *s, stdin=f"{scratch}/state.json", cwd=scratch).returncode
                        for s in _SCENARIOS]
            _check_scenario_results(scratch, statuses, f"{bundle}/{LAUNCHER}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except subprocess.TimeoutExpired:
        return f"{bundle}/{LAUNCHER}: no answer within {RUN_TIMEOUT:g} s"
    except OSError as err:
        return f"{bundle}/{LAUNCHER}: cannot run: {err.strerror}"
    except DevinjectError as err:
        return err.message
    return None


STAGING_PREFIXES = (".devinject-node-hook-check-",)  # with `.<bundle name>.new-`: what an install leaves when killed


def ancestors_problem(host_root: str, directory: str) -> str | None:
    """Why a directory above the bundle (the host's / down to its parent, as the host names them) lets someone
    but root swap the bundle root then runs: owned by another user, or writable by group or others (a sticky
    one, like /tmp, lets nobody rename what is root's). None when every one is root's alone."""
    from devinject.cdi.spec import trust_problem

    parts = [p for p in directory.strip("/").split("/") if p][:-1]
    for depth in range(len(parts) + 1):
        host_path = "/" + "/".join(parts[:depth])
        here = in_root(host_root, host_path) if depth else os.path.normpath(host_root)
        try:
            problem = trust_problem(os.stat(here), directory=True)
        except FileNotFoundError:
            return None  # below here nothing exists yet: install makes it, --check finds no bundle
        except OSError as err:
            return f"{here}: {err.strerror}"
        if problem:
            return f"{here}: a directory above the node hook is {problem}: another user could replace the bundle"
    return None


def owners_problem(bundle: str) -> str | None:
    """The first entry of the bundle whose owner is not the bundle's (root's): its owner could change it (a
    mode in the stamp's hash does not stop a chmod), or that is writable by group or others."""
    owner = os.lstat(bundle).st_uid
    for top, dirs, names in os.walk(bundle):
        for name in dirs + names:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if st.st_uid != owner:
                return f"{path}: owned by uid {st.st_uid}, not {owner} as the bundle is"
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                return f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def clean_staging(parent: str, name: str) -> int:
    """Remove what killed installs left beside the bundle (stages, scratch containers): directories only,
    never through a link. Only under the install lock: no install is running then."""
    removed = 0
    for entry in os.listdir(parent):
        if not (entry.startswith(f".{name}.new-") or entry.startswith(STAGING_PREFIXES)):
            continue
        path = os.path.join(parent, entry)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
                removed += 1
        except OSError:
            continue
    return removed


def node_hook_ready(host_root: str, directory: str = DEFAULT_DIR, *, run: bool = True) -> str | None:
    """Why the node hook at `directory` (a host path; the host's / is at `host_root` here) cannot serve this
    agent's specs, or None when it can: installed, root's alone, this agent's version and build, unchanged
    since it was installed, and (with `run`) its launcher answers `--version`. The build is this agent's when
    every file the bundle copied (interpreter, libraries, modules) is unchanged here: an edit of a module the
    cdi-hook does not import does not make it stale."""
    from devinject.linux.trusteddir import dir_problem

    bundle = in_root(host_root, directory)
    try:
        problem = dir_problem(os.lstat(bundle))
    except FileNotFoundError:
        return f"{bundle}: no node hook installed"
    except OSError as err:
        return f"{bundle}: {err.strerror}"
    if problem:
        return f"{bundle}: {problem}"
    problem = ancestors_problem(host_root, directory)
    if problem:
        return problem
    try:
        problem = owners_problem(bundle)
    except OSError as err:
        return f"{bundle}: unreadable: {err.strerror}"
    if problem:
        return problem
    try:
        stamp = json.loads(Path(bundle, STAMP).read_text())
        if not isinstance(stamp, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        return f"{bundle}: no {STAMP}: not a node hook, or one whose install did not finish"
    except (OSError, ValueError) as err:
        return f"{bundle}/{STAMP}: unreadable: {getattr(err, 'strerror', None) or err}"
    if stamp.get("version") != __version__:
        return f"{bundle}: stale: devinject {stamp.get('version')}'s node hook, this agent is {__version__}"
    stale = stale_sources(stamp.get("sources"))
    if stale:
        return f"{bundle}: stale: {stale}"
    try:
        content = content_digest(bundle)[0]
    except OSError as err:
        return f"{bundle}: unreadable: {err.strerror}"
    if content != stamp.get("content"):
        return f"{bundle}: changed since it was installed (its content no longer matches {STAMP})"
    return _runs(bundle) if run else None


def _exchange(source: str, target: str) -> None:
    """Swap two directories of one filesystem in one step (renameat2 RENAME_EXCHANGE)."""
    from devinject.linux import libc

    if libc.function("renameat2")(_AT_FDCWD, source.encode(), _AT_FDCWD, target.encode(), _RENAME_EXCHANGE) != 0:
        raise OSError(libc.errno(), os.strerror(libc.errno()), target)


def install_node_hook(host_root: str = "/", directory: str = DEFAULT_DIR, *, force: bool = False) -> Installed:
    """Install this agent's node hook at `directory` (a host path; the host's / is at `host_root` here), unless
    the one there is already ready (`force`: rebuild anyway). The new bundle is built and run in a sibling
    directory, then exchanged with the installed one, which is removed only after the new one runs in place."""
    from devinject.linux.filelock import exclusive

    bundle = in_root(host_root, directory)
    parent, name = os.path.split(bundle)
    _trusted_parent(host_root, directory, parent)
    with exclusive(os.path.join(parent, f".{name}.lock"), timeout=LOCK_TIMEOUT, what="node hook install"):
        clean_staging(parent, name)
        if os.path.lexists(bundle):
            _check_replaceable(bundle, parent)
            if not force and node_hook_ready(host_root, directory) is None:
                count, size = content_digest(bundle)[1:]
                return Installed(hook_path(directory), False, count, size)
        try:
            stage = tempfile.mkdtemp(prefix=f".{name}.new-", dir=parent)
        except OSError as err:
            raise DevinjectError(f"{parent}: cannot write: {err.strerror}") from None
        try:
            count, size = build(stage, directory.rstrip("/"), parent)
            _put_in_place(stage, bundle, parent)
        except OSError as err:
            raise DevinjectError(f"{bundle}: cannot install the node hook: {err.strerror or err}") from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return Installed(hook_path(directory), True, count, size)


def _trusted_parent(host_root: str, directory: str, parent: str) -> None:
    """The bundle's parent made, and trusted: first, nothing is made under a directory others can write."""
    from devinject.linux.trusteddir import make_dirs, trusted_dir

    problem = ancestors_problem(host_root, directory)
    if problem:
        raise DevinjectError(problem)
    try:
        make_dirs(parent)
    except OSError as err:
        raise DevinjectError(f"{parent}: cannot create: {err.strerror}") from None
    trusted_dir(parent, what="node hook's parent directory")


def _check_replaceable(bundle: str, parent: str) -> None:
    """The installed bundle can be exchanged with a new one beside it: a directory, on its parent's mount."""
    st = os.lstat(bundle)
    if not stat.S_ISDIR(st.st_mode):
        raise DevinjectError(f"{bundle}: is not a directory; remove it, or choose another --dir")
    if st.st_dev != os.stat(parent).st_dev:
        raise DevinjectError(f"{bundle}: is a mount point; mount its parent directory instead "
                             "(the new bundle is renamed into place beside it)")


def _put_in_place(stage: str, bundle: str, parent: str) -> None:
    """The new bundle built at `stage` to `bundle`, once it runs there and again in place; where it does not,
    the previous bundle (or none) is back at `bundle` and the new one at `stage`, to be removed."""
    problem = _runs(stage, parent)
    if problem:
        raise DevinjectError(f"the new node hook does not run, the installed one is kept: {problem}")
    if os.path.lexists(bundle):
        _exchange(stage, bundle)  # the previous bundle is now at `stage`
        problem = _runs(bundle)
        if problem:
            _exchange(stage, bundle)
            raise DevinjectError(f"the new node hook does not run in place, the previous one is back: "
                                 f"{problem}")
    else:
        os.rename(stage, bundle)
        problem = _runs(bundle)
        if problem:
            os.rename(bundle, stage)
            raise DevinjectError(f"the new node hook does not run in place, removed: {problem}")
    _sync(parent)


def _sync(directory: str) -> None:
    """The new bundle's files and the rename that put it in place survive a crash."""
    os.sync()
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
