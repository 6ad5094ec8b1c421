"""Driver files on the host: libraries through ld.so.cache, binaries on the standard PATH, globbed files."""

from __future__ import annotations

import fnmatch
import logging
import platform
import posixpath
import stat
from dataclasses import dataclass

from devinject.core.errors import LdCacheError
from devinject.core.ldcache import ARCH_AARCH64, ARCH_PPC64, ARCH_X86_64, LdCacheEntry, parse_ldcache
from devinject.discovery.host import Host

log = logging.getLogger(__name__)

LDCACHE_PATH = "/etc/ld.so.cache"
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/bin", "/sbin")
_ARCH_BY_MACHINE = {"x86_64": ARCH_X86_64, "aarch64": ARCH_AARCH64, "ppc64le": ARCH_PPC64}


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
    found: list[LocatedFile] = []
    for pattern in patterns:
        try:
            expanded = pattern.format(**{k: v for k, v in fields.items() if v is not None})
        except KeyError:
            continue
        found.extend(LocatedFile(path, host.resolve(path)) for path in host.glob(expanded))
    return found
