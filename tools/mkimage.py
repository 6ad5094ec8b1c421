#!/usr/bin/env python3
"""Build the devinject agent image with no container registry: `make image`.

1. The root filesystem comes from Debian's archive with mmdebstrap (Essential set plus
   deploy/image/packages.txt, no docs, man pages or locales); that tree is cached in the work directory,
   keyed on everything that goes into it.
2. The image keeps only the listed packages and their Depends/Pre-Depends: the files of every other package
   (the ones dpkg needed to install them) go, and so do their dpkg records, dangling links, apt's and
   dpkg's leftovers and the caches. deploy/image/files.txt names single files kept from a package that is
   installed for them alone (`journalctl` of `systemd`: the package whole is a service manager the image
   never runs); the libraries such a file needs must come with the kept packages (the build checks it).
3. The wheels of deploy/image/requirements.txt (binary only, pinned by hash, for the image's Python and
   glibc) and devinject from this tree go into /usr/local, byte-compiled (unchecked-hash, so a read-only
   root never recompiles); /usr/local/bin/devinject is the entrypoint.
4. One layer (sorted, numeric owners, mtimes clamped to SOURCE_DATE_EPOCH or the last commit), written as
   an OCI image layout archive that `ctr images import`, `podman load` and `skopeo copy oci-archive:` read.

Usage: mkimage.py [--output build/devinject-image.tar] [--name localhost/devinject:VERSION] [--work build/image]
Needs root (mmdebstrap --mode=root, numeric owners), mmdebstrap and pip (this interpreter's).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "deploy" / "image"
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",  # the licences stay
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
    # glibc's iconv(3) charset modules (8 MiB): Python's codecs are its own, and nothing here calls iconv
    "path-exclude=/usr/lib/x86_64-linux-gnu/gconv/*",
    # gdb's pretty-printers and auto-loads (libstdc++'s)
    "path-exclude=/usr/share/gcc/*",
    "path-exclude=/usr/share/gdb/*",
)
EXCLUDED_DIRS = tuple(option.split("=/", 1)[1].removesuffix("/*") for option in DPKG_OPTIONS
                      if option.startswith("path-exclude="))
# What the build leaves that no package owns and the image does not need (the build's package manager, its
# logs and caches, and what the runtime mounts over).
EMPTIED = ("var/cache", "var/log", "tmp", "run", "dev", "proc", "sys")
LEFTOVERS = ("etc/apt", "var/lib/apt", "usr/share/info/dir", "etc/machine-id", "etc/resolv.conf", "etc/hostname",
             "var/lib/dpkg/status-old",
             "var/lib/dpkg/available", "var/lib/dpkg/diversions-old", "var/lib/dpkg/statoverride-old",
             "var/lib/dpkg/lock", "var/lib/dpkg/lock-frontend", "var/lib/dpkg/triggers/Lock")
# The Debian tree's own time (shadow's last change, py_compile's mode): pinned, so a rebuilt tree is the same
# tree; the image's mtimes are clamped to SOURCE_DATE_EPOCH besides. Debian 12.0's release.
DEBIAN_EPOCH = 1686355200
# Debian's byte-code as unchecked-hash: valid whatever the mtimes, never checked against the source (which
# never changes in an image), so a read-only root never compiles.
RECOMPILE = """import pathlib, py_compile, sys
for cached in sorted(pathlib.Path(sys.argv[1]).rglob("__pycache__/*.cpython-*.pyc")):
    source = cached.parent.parent / (cached.name.split(".")[0] + ".py")
    if source.exists():
        py_compile.compile(str(source), str(cached), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
"""
LAUNCHER = "#!/usr/bin/python3 -I\nimport sys\n\nfrom devinject.entry import main\n\nsys.exit(main())\n"


class BuildError(Exception):
    pass


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise BuildError(f"{cmd[0]} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")
    return done  # type: ignore[no-any-return]


def recipe_lines(name: str) -> list[str]:
    lines = (RECIPE / name).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def kept_files(lines: list[str]) -> tuple[tuple[str, str], ...]:
    """files.txt's `<package> <absolute path>` lines: a file kept from a package the image drops."""
    out: list[tuple[str, str]] = []
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("/") or ".." in parts[1].split("/"):
            raise BuildError(f"files.txt: {line!r}: expected `<package> <absolute path>`")
        out.append((parts[0], parts[1]))
    return tuple(out)


# --- the Debian tree ------------------------------------------------------------------------------------------

def debian_tree(work: Path, packages: list[str]) -> Path:
    """The mmdebstrap tree for these packages, built once per key (packages, suite, mirrors, options,
    mmdebstrap's version)."""
    version = run(["mmdebstrap", "--version"]).stdout.strip()
    key_text = json.dumps([packages, SUITE, MIRRORS, DPKG_OPTIONS, version, "essential", "merged-usr", DEBIAN_EPOCH,
                           RECOMPILE])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    tree = work / f"debian-{key}"
    if (work / f"debian-{key}.done").exists() and tree.is_dir():
        return tree
    for old in work.glob("debian-*"):  # another key's tree, or a build cut off
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    command = ["mmdebstrap", "--variant=essential", "--mode=root", "--format=directory", "--quiet",
               "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr", f"--include={','.join(packages)}",
               *(f"--dpkgopt={option}" for option in DPKG_OPTIONS), SUITE, str(tree), *MIRRORS]
    with open(work / "mmdebstrap.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=1200,
                              env={**os.environ, "SOURCE_DATE_EPOCH": str(DEBIAN_EPOCH)})
    if done.returncode != 0:
        raise BuildError(f"mmdebstrap failed ({done.returncode}): see {work / 'mmdebstrap.log'}")
    for top in ("/usr/lib", "/usr/share"):
        run(["chroot", str(tree), "/usr/bin/python3", "-I", "-c", RECOMPILE, top], timeout=600)
    (work / f"debian-{key}.done").write_text(key_text + "\n")
    return tree


def parse_status(text: str) -> dict[str, dict[str, str]]:
    """dpkg's status file: installed packages by name, each paragraph's fields (continuation lines joined)."""
    packages: dict[str, dict[str, str]] = {}
    for paragraph in text.split("\n\n"):
        fields: dict[str, str] = {}
        last = ""
        for line in paragraph.splitlines():
            if line[:1] in (" ", "\t") and last:
                fields[last] += "\n" + line
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            packages[fields["Package"]] = fields
    return packages


def _names(field: str) -> list[list[str]]:
    """A Depends-style field as its groups of alternatives, names only (no versions, arch qualifiers)."""
    groups = []
    for group in field.split(","):
        names = [re.split(r"[\s(:\[]", alternative.strip(), maxsplit=1)[0] for alternative in group.split("|")]
        if names := [name for name in names if name]:
            groups.append(names)
    return groups


def closure(installed: dict[str, dict[str, str]], roots: list[str]) -> set[str]:
    """The roots and every package their Depends and Pre-Depends need, among the installed ones: each group
    of alternatives is met by its first installed alternative, a package or what provides it."""
    providers: dict[str, list[str]] = {}
    for name, fields in installed.items():
        for (virtual, *_) in _names(fields.get("Provides", "")):
            providers.setdefault(virtual, []).append(name)
    missing = [root for root in roots if root not in installed]
    if missing:
        raise BuildError(f"packages.txt: not installed by mmdebstrap: {', '.join(missing)}")
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        fields = installed[name]
        for group in _names(fields.get("Pre-Depends", "")) + _names(fields.get("Depends", "")):
            met = [name for alternative in group
                   for name in ([alternative] if alternative in installed else providers.get(alternative, []))]
            if not met:
                raise BuildError(f"{name}: dependency {' | '.join(group)} is not installed")
            todo.append(met[0])
    return keep


# --- the image's tree -----------------------------------------------------------------------------------------

def _inside(stage: Path, path: str) -> str:
    """A package's path as the stage holds it, with directory aliases (merged /usr) resolved in the stage."""
    parent, base = os.path.split(path.rstrip("/"))
    real = os.path.realpath(str(stage) + parent)
    if real != str(stage) and not real.startswith(str(stage) + os.sep):
        real = str(stage) + parent
    return os.path.join(real, base)


def _owned(stage: Path, package: str) -> set[str]:
    info = stage / "var/lib/dpkg/info"
    for name in (f"{package}.list", f"{package}:{arch(stage)}.list"):
        if (info / name).exists():
            return {_inside(stage, line) for line in (info / name).read_text().splitlines()
                    if line and line != "/."}
    return set()


def arch(stage: Path) -> str:
    return (stage / "var/lib/dpkg/arch").read_text().split()[0] if (stage / "var/lib/dpkg/arch").exists() \
        else "amd64"


def trim(stage: Path, keep: set[str], installed: dict[str, dict[str, str]],
         files: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """Drop every installed package outside keep from the stage: its files (not those a kept package also
    owns, nor the `files` kept of it), its dpkg records; then the links left dangling and the build's
    leftovers. Returns the dropped."""
    dropped = set(installed) - keep
    kept_paths: set[str] = set().union(*(_owned(stage, name) for name in keep))
    for package, path in files:
        if _inside(stage, path) not in _owned(stage, package):
            raise BuildError(f"files.txt: {path} is not a file of {package}")
        kept_paths.add(_inside(stage, path))
    gone: set[str] = set().union(*(_owned(stage, name) for name in dropped)) - kept_paths
    for path in sorted(gone, key=lambda p: (p.count(os.sep), p), reverse=True):  # files before their dirs
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
    info = stage / "var/lib/dpkg/info"
    for entry in info.iterdir():
        if entry.name.rsplit(".", 1)[0].split(":")[0] in dropped:
            entry.unlink()
    status = (stage / "var/lib/dpkg/status").read_text().split("\n\n")
    kept = [p for p in status if p.strip() and parse_status(p).keys() & keep]
    _replace(stage / "var/lib/dpkg/status", "\n\n".join(p.strip("\n") for p in kept) + "\n")
    for relative in EMPTIED:
        for entry in sorted((stage / relative).glob("*")):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for relative in LEFTOVERS:
        leftover = stage / relative
        shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink(missing_ok=True)
    for top in EXCLUDED_DIRS:  # the directories the path-excludes emptied
        for directory, _dirs, _files in sorted(os.walk(stage / top), reverse=True):
            if not os.listdir(directory):
                os.rmdir(directory)
    _drop_dangling(stage)
    for entry in sorted((stage / "var/lib/dpkg/alternatives").glob("*")):
        if not os.path.lexists(stage / "etc/alternatives" / entry.name):
            entry.unlink()
    return sorted(dropped)


def _resolves(stage: Path, link: Path, depth: int = 0) -> bool:
    target = os.readlink(link)
    path = Path(str(stage) + target) if target.startswith("/") else link.parent / target
    if depth > 20:
        return False
    if path.is_symlink():
        return _resolves(stage, path, depth + 1)
    parent = os.path.realpath(path.parent)
    return os.path.lexists(path) and (parent == str(stage) or parent.startswith(str(stage) + os.sep))


def _drop_dangling(stage: Path) -> None:
    while True:
        dangling = [Path(top) / name for top, dirs, files in os.walk(stage) for name in dirs + files
                    if os.path.islink(Path(top) / name) and not _resolves(stage, Path(top) / name)]
        if not dangling:
            return
        for link in dangling:
            link.unlink()


def _replace(path: Path, text: str) -> None:
    """A new file in place of path (never writing through it: the stage hard-links the cached tree)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def python_of(installed: dict[str, dict[str, str]]) -> tuple[str, tuple[int, int]]:
    """The image's Python (X.Y) and glibc (major, minor), from the packages."""
    match = re.match(r"(\d+\.\d+)", installed["python3"]["Version"])
    libc = re.match(r"(\d+)\.(\d+)", installed["libc6"]["Version"])
    if not match or not libc:
        raise BuildError("python3 or libc6: unreadable version")
    if match.group(1) != f"{sys.version_info[0]}.{sys.version_info[1]}":
        raise BuildError(f"the image's Python is {match.group(1)}: run this with a Python of that version")
    return match.group(1), (int(libc.group(1)), int(libc.group(2)))


def install_python(stage: Path, python: str, glibc: tuple[int, int], work: Path, tree: Path = REPO) -> Path:
    """The pinned wheels and devinject from this tree into the stage's /usr/local, byte-compiled."""
    site = stage / f"usr/local/lib/python{python}/dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_{glibc[0]}_{minor}_x86_64" for minor in range(glibc[1], 16, -1)]
    platforms += ["manylinux2014_x86_64", "linux_x86_64"]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(site)]
    tags = ["--implementation", "cp", "--abi", f"cp{python.replace('.', '')}", "--python-version", python,
            *(f"--platform={platform}" for platform in platforms)]
    run([*pip, "--only-binary=:all:", "--require-hashes", *tags, "-r", str(RECIPE / "requirements.txt")], timeout=600)
    source = Path(tempfile.mkdtemp(prefix="src-", dir=work))
    try:  # only what the package is built from, never the checkout's build/ or egg-info
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(tree / name, source / name)
        shutil.copytree(tree / "src" / "devinject", source / "src" / "devinject",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        run([*pip, "--no-build-isolation", str(source)], timeout=600)
    finally:
        shutil.rmtree(source)
    shutil.rmtree(site / "bin", ignore_errors=True)  # pip's scripts name this interpreter; ours is below
    for record in site.glob("*.dist-info/direct_url.json"):  # the build's temporary source directory
        record.unlink()
    launcher = stage / "usr/local/bin/devinject"
    launcher.parent.mkdir(parents=True, exist_ok=True)
    launcher.write_text(LAUNCHER)
    launcher.chmod(0o755)
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache)
    for record in site.glob("*.dist-info/RECORD"):  # what pip installed and still is there
        lines = record.read_text().splitlines()
        _replace(record, "".join(line + "\n" for line in lines
                                 if (record.parent.parent / line.split(",", 1)[0]).exists()))
    # one process, in compileall's sorted order: marshal's output depends on what the compiling process holds
    # (its reference flags), so the same files in the same order give the same bytes; workers might not
    run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash",
         "-s", str(stage), "-p", "/", str(site)], timeout=600)
    return site


IMPORT_ALL = """import importlib, pkgutil, sys, devinject
for module in pkgutil.walk_packages(devinject.__path__, "devinject."):
    if module.name not in ("devinject.__main__", "devinject.hook.launcher"):  # programs: they run on import
        importlib.import_module(module.name)
print("imported", len(sys.modules))
"""


def verify(stage: Path) -> None:
    """The trimmed tree still runs: every ELF file's libraries are found by the image's loader, and every
    devinject module imports with the image's Python (what a dropped package or a missing one breaks)."""
    elves = []
    for top, _dirs, files in os.walk(stage):
        for name in files:
            path = Path(top) / name
            if not path.is_symlink() and path.is_file():
                with open(path, "rb") as data:
                    if data.read(4) == b"\x7fELF":
                        elves.append("/" + str(path.relative_to(stage)))
    loader = "/lib64/ld-linux-x86-64.so.2"
    broken = []
    for elf in sorted(elves):
        done = subprocess.run(["chroot", str(stage), loader, "--list", elf], capture_output=True, text=True,
                              timeout=60)
        broken += [f"{elf}: {line.strip()}" for line in done.stdout.splitlines() if "not found" in line]
    if broken:
        raise BuildError("libraries missing in the image: " + "; ".join(broken[:10]))
    done = run(["chroot", str(stage), "/usr/bin/python3", "-I", "-B", "-c", IMPORT_ALL], timeout=120)
    if not done.stdout.startswith("imported "):
        raise BuildError(f"importing devinject's modules in the image stopped early: {done.stdout[-500:]}")


# --- the image --------------------------------------------------------------------------------------------------

def write_layer(stage: Path, out: Path, epoch: int) -> str:
    """The stage as one uncompressed layer: sorted, numeric owners, mtimes clamped to epoch; its sha256."""
    def clamp(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = min(int(info.mtime), epoch)
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for top, dirs, files in os.walk(stage):
            dirs.sort()
            for name in sorted(dirs + files):
                path = Path(top) / name
                if not (path.is_symlink() or path.is_dir() or path.is_file()):
                    raise BuildError(f"{path}: not a file, directory or link")
                info = clamp(tar.gettarinfo(str(path), str(path.relative_to(stage))))
                if info.isreg():
                    with open(path, "rb") as data:
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
    return _sha256(out)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        while chunk := data.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_archive(out: Path, layer: Path, diff_id: str, name: str, version: str, epoch: int,
                  architecture: str) -> dict[str, int]:
    blobs: dict[str, bytes | Path] = {}
    compressed = layer.with_suffix(".tar.gz")
    with open(layer, "rb") as source, open(compressed, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as packed:
        shutil.copyfileobj(source, packed, 1 << 20)
    layer_digest = _sha256(compressed)
    blobs[layer_digest] = compressed
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    config = {
        "architecture": architecture, "os": "linux", "created": created,
        "config": {"Entrypoint": ["devinject"], "Cmd": ["device-plugin", "--help"], "WorkingDir": "/",
                   "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
                   "Labels": {"org.opencontainers.image.title": "devinject",
                              "org.opencontainers.image.version": version,
                              "org.opencontainers.image.licenses": "Apache-2.0"}},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created": created, "created_by": f"tools/mkimage.py: Debian {SUITE} (mmdebstrap), "
                     "deploy/image/requirements.txt, devinject from its tree"}],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    config_digest = hashlib.sha256(config_bytes).hexdigest()
    blobs[config_digest] = config_bytes
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{config_digest}", "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": f"sha256:{layer_digest}", "size": compressed.stat().st_size}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest = hashlib.sha256(manifest_bytes).hexdigest()
    blobs[manifest_digest] = manifest_bytes
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [{
        "mediaType": manifest["mediaType"], "digest": f"sha256:{manifest_digest}", "size": len(manifest_bytes),
        "platform": {"architecture": architecture, "os": "linux"},
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name}}]}
    files: dict[str, bytes | Path] = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
                                      "index.json": json.dumps(index, sort_keys=True).encode()}
    files.update({f"blobs/sha256/{digest}": blob for digest, blob in blobs.items()})
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        for member, blob in sorted(files.items()):
            info = tarfile.TarInfo(member)
            info.mode, info.mtime = 0o644, epoch
            if isinstance(blob, Path):
                info.size = blob.stat().st_size
                with open(blob, "rb") as data:
                    tar.addfile(info, data)
            else:
                info.size = len(blob)
                tar.addfile(info, _Bytes(blob))
    os.replace(tmp, out)
    size = compressed.stat().st_size
    compressed.unlink()
    return {"layer": layer.stat().st_size, "compressed": size, "archive": out.stat().st_size}


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size < 0 else self.offset + size
        chunk, self.offset = self.data[self.offset:end], min(end, len(self.data))
        return chunk


@contextlib.contextmanager
def locked(work: Path, timeout: float = 900.0) -> Iterator[None]:
    """One build at a time in a work directory (two `make image` at once would share its stage)."""
    with open(work / "lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"{work / 'lock'}: another build held it for {timeout:.0f} s") from None
                time.sleep(0.5)
        yield


def source_date_epoch() -> int:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    done = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else 0


def main(argv: list[str] | None = None) -> int:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPO / "build" / "devinject-image.tar")
    parser.add_argument("--name", default=f"localhost/devinject:{version}")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "image")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the devinject tree to install (pyproject.toml, README.md, src/devinject)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if os.geteuid() != 0:
            raise BuildError("needs root (mmdebstrap --mode=root, and the image's files are root's)")
        if shutil.which("mmdebstrap") is None:
            raise BuildError("mmdebstrap not installed (make system-deps)")
        args.work.mkdir(parents=True, exist_ok=True)
        with locked(args.work):
            packages = recipe_lines("packages.txt")
            files = kept_files(recipe_lines("files.txt"))
            tree = debian_tree(args.work, [*packages, *sorted({p for p, _ in files} - set(packages))])
            stage = args.work / "stage"
            shutil.rmtree(stage, ignore_errors=True)
            run(["cp", "-a", "--link", str(tree), str(stage)])
            installed = parse_status((stage / "var/lib/dpkg/status").read_text())
            keep = closure(installed, packages)
            dropped = trim(stage, keep, installed, files)
            python, glibc = python_of(installed)
            install_python(stage, python, glibc, args.work, args.source)
            run(["ldconfig", "-r", str(stage)])  # the image's own libraries only
            shutil.rmtree(stage / "var/cache/ldconfig", ignore_errors=True)
            verify(stage)
            layer = args.work / "layer.tar"
            diff_id = write_layer(stage, layer, source_date_epoch())
            args.output.parent.mkdir(parents=True, exist_ok=True)
            sizes = write_archive(args.output, layer, diff_id, args.name, version, source_date_epoch(), arch(stage))
            layer.unlink()
    except (BuildError, OSError, subprocess.TimeoutExpired) as error:
        print(f"mkimage: {error}", file=sys.stderr)
        return 1
    mib = 1 << 20
    print(f"wrote {args.output}: {args.name}, {len(keep)} Debian packages ({len(dropped)} of the build dropped), "
          f"{sizes['layer'] / mib:.1f} MiB unpacked, {sizes['archive'] / mib:.1f} MiB archive, "
          f"{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
