"""Driver files on the host: libraries through ld.so.cache, binaries on the standard PATH, globbed files."""

from __future__ import annotations

import fnmatch
import logging
import os
import platform
import posixpath
import stat
from dataclasses import dataclass

from devinject.core.errors import LdCacheError
from devinject.discovery.host import Host
from devinject.discovery.profiles import DriverLibraries
from devinject.linux.ldcache import ARCH_AARCH64, ARCH_PPC64, ARCH_X86_64, LdCacheEntry, parse_ldcache

log = logging.getLogger(__name__)

LDCACHE_PATH = "/etc/ld.so.cache"
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/bin", "/sbin")
_ARCH_BY_MACHINE = {"x86_64": ARCH_X86_64, "aarch64": ARCH_AARCH64, "ppc64le": ARCH_PPC64}
DRIVER_VERSION_FIELD = "{driver_version}"  # in a library pattern: the running driver's files only


@dataclass(frozen=True, slots=True)
class LocatedFile:
    """`path` as the host names it (a SONAME link, say) and `real`, the file its link chain ends at."""

    path: str
    real: str


def native_arch() -> int:
    return _ARCH_BY_MACHINE.get(platform.machine(), ARCH_X86_64)


def read_ldcache(host: Host) -> list[LdCacheEntry]:
    data = host.read_bytes(LDCACHE_PATH)
    if data is None:
        log.info("no %s: libraries will not be found", host.real(LDCACHE_PATH))
        return []
    try:
        return parse_ldcache(data)
    except LdCacheError as err:
        raise LdCacheError(f"{host.real(LDCACHE_PATH)}: {err}") from None


def locate_libraries(host: Host, entries: list[LdCacheEntry], patterns: tuple[str, ...],
                     arch: int) -> list[LocatedFile]:
    """Cache entries whose SONAME matches a pattern, native arch only, resolved to regular files."""
    found: dict[str, LocatedFile] = {}
    for entry in entries:
        if entry.arch != arch or entry.is_hwcaps_subdir or entry.path in found:
            continue
        if not any(fnmatch.fnmatchcase(entry.soname, p) for p in patterns):
            continue
        real = host.resolve(entry.path)
        st = host.lstat(real)
        if st is None or not stat.S_ISREG(st.st_mode):
            log.warning("ld.so.cache names %s but %s is not a file; skipped", entry.path, host.real(real))
            continue
        found[entry.path] = LocatedFile(entry.path, real)
    return sorted(found.values(), key=lambda f: f.path)


def soname_of(host: Host, path: str) -> str | None:
    """The SONAME of the ELF shared object at host `path` (None when it is not one)."""
    from devinject.linux.elfinfo import read_shared_object

    try:
        fd = os.open(host.real(host.resolve(path)), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        found = read_shared_object(fd)
    finally:
        os.close(fd)
    return found.soname if found else None


def locate_driver_libraries(host: Host, entries: list[LdCacheEntry], rule: DriverLibraries, arch: int,
                            driver_version: str | None) -> list[LocatedFile]:
    """Every library the driver installed next to `rule.anchor` (and in its subdirectories) whose name
    matches a pattern: each named by its SONAME link when the host has one pointing at it.

    Only the running driver's: a pattern with `{driver_version}` takes that version's files alone, and a
    library with a version of its own (`libnvidia-egl-wayland.so.1.1.13`) is left out when its SONAME link
    names another file: a version an upgrade left behind, which no program on the host loads."""
    anchors = locate_libraries(host, entries, (rule.anchor,), arch)
    if not anchors:
        return []
    own = tuple(p for p in rule.patterns if DRIVER_VERSION_FIELD not in p)
    pinned = expand_fields(tuple(p for p in rule.patterns if p not in own), driver_version=driver_version)
    patterns = [*pinned, *own]
    top = posixpath.dirname(anchors[0].real)
    found: list[LocatedFile] = []
    for directory in (top, *(posixpath.join(top, sub) for sub in rule.subdirs)):
        names = host.listdir(directory)
        for name in names:
            path = posixpath.join(directory, name)
            if (not any(fnmatch.fnmatchcase(name, p) for p in patterns)
                    or any(fnmatch.fnmatchcase(name, x) for x in rule.exclude) or host.is_link(path)):
                continue
            st = host.lstat(path)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            soname = soname_of(host, path)
            link = posixpath.join(directory, soname) if soname and soname != name and soname in names else None
            current = link is not None and host.resolve(link) == host.resolve(path)
            if link is not None and not current and not any(fnmatch.fnmatchcase(name, p) for p in pinned):
                log.info("%s left out: its SONAME link %s names another version", host.real(path), soname)
                continue
            found.append(LocatedFile(link if current and link else path, path))
    return sorted(found, key=lambda f: f.path)


def locate_binaries(host: Host, names: tuple[str, ...]) -> list[LocatedFile]:
    found = []
    for name in names:
        for directory in BINARY_DIRS:
            path = posixpath.join(directory, name)
            if host.exists(path) and not host.is_dir(path):
                found.append(LocatedFile(path, host.resolve(path)))
                break
    return found


def locate_files(host: Host, patterns: tuple[str, ...], **fields: str | None) -> list[LocatedFile]:
    """Globbed files and directories; a pattern whose template field is unknown is skipped."""
    return [LocatedFile(path, host.resolve(path))
            for pattern in expand_fields(patterns, **fields) for path in host.glob(pattern)]


def expand_fields(patterns: tuple[str, ...], **fields: str | None) -> list[str]:
    """`patterns` with their `{field}`s filled in; one naming a field that is unknown here is skipped."""
    known = {k: v for k, v in fields.items() if v is not None}
    out = []
    for pattern in patterns:
        try:
            out.append(pattern.format(**known))
        except KeyError as err:
            log.info("pattern %s skipped: {%s} is not known here", pattern, err.args[0])
    return out
