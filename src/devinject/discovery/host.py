"""Read-only access to a host's files under a root directory (`/` in production, a fixture tree in tests).

Paths given to and returned by `Host` are host-view paths (`/sys/bus/pci/devices`); `Host.real()` maps one
onto the real filesystem. Symlinks are resolved by `Host.resolve()` as if `root` were `/`: an absolute link
target is re-rooted, never followed onto the machine running the tests.

A file that is not there reads as absent (None, no entries, False); a file this process may not read raises
DiscoveryError naming it. Everything discovery and health read is world-readable on a real host (sysfs
identity, link and AER attributes, `uevent`, `/proc/devices`, the drivers' procfs files, `ld.so.cache`; never
the root-only `config` tail, `resource*` or `rom`), so a denial is a confined or non-root reader that would
otherwise see fewer devices, or a failing one as healthy, and say nothing.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from devinject.core.errors import DiscoveryError

_MAX_LINK_HOPS = 40
_DENIED = (errno.EACCES, errno.EPERM)


def _absent_unless_denied(err: OSError, real: str) -> None:
    """Returns for a file that is not there (or not readable as asked: a directory opened as a file, a dead
    device's EIO); raises for one this process is not allowed to read."""
    if err.errno in _DENIED:
        raise DiscoveryError(f"{real}: permission denied (uid {os.geteuid()} may not read it)") from None


def _norm(path: str) -> str:
    """Absolute, normalised, `..` clamped at `/` (and no POSIX `//` prefix)."""
    return posixpath.normpath("/" + path.lstrip("/"))


class Host:
    def __init__(self, root: str = "/") -> None:
        self.root = os.path.abspath(root)
        self._links: dict[str, str | None] = {}  # readlink memo; `refresh()` forgets it

    def refresh(self) -> None:
        """Forget memoised links (a long-running reader calls this before each rescan)."""
        self._links.clear()

    def real(self, path: str) -> str:
        """The path on this machine's filesystem for host path `path` (lexical, links not followed)."""
        rel = _norm(path).lstrip("/")
        return os.path.join(self.root, rel) if rel else self.root

    def read_text(self, path: str) -> str | None:
        """File contents, or None when it is missing or cannot be read (DiscoveryError when denied)."""
        real = self.real(self.resolve(path))
        try:
            with open(real, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError as err:
            _absent_unless_denied(err, real)
            return None

    def read_bytes(self, path: str) -> bytes | None:
        real = self.real(self.resolve(path))
        try:
            with open(real, "rb") as handle:
                return handle.read()
        except OSError as err:
            _absent_unless_denied(err, real)
            return None

    def read_attr(self, path: str) -> str | None:
        """A sysfs attribute: contents without the trailing newline the kernel always prints."""
        text = self.read_text(path)
        return None if text is None else text.strip()

    def listdir(self, path: str) -> list[str]:
        real = self.real(self.resolve(path))
        try:
            return sorted(os.listdir(real))
        except OSError as err:
            _absent_unless_denied(err, real)
            return []

    def _stat(self, real: str, *, follow: bool) -> os.stat_result | None:
        try:
            return os.stat(real) if follow else os.lstat(real)
        except OSError as err:
            _absent_unless_denied(err, real)
            return None
        except ValueError:  # a NUL in the name: no such file
            return None

    def exists(self, path: str) -> bool:
        return self._stat(self.real(self.resolve(path)), follow=False) is not None

    def is_dir(self, path: str) -> bool:
        st = self._stat(self.real(self.resolve(path)), follow=True)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def is_link(self, path: str) -> bool:
        st = self._stat(self.real(path), follow=False)
        return st is not None and stat.S_ISLNK(st.st_mode)

    def readlink(self, path: str) -> str | None:
        try:
            return self._links[path]
        except KeyError:
            pass
        real = self.real(path)
        try:
            target: str | None = os.readlink(real)
        except OSError as err:
            _absent_unless_denied(err, real)
            target = None
        self._links[path] = target
        return target

    def lstat(self, path: str) -> os.stat_result | None:
        return self._stat(self.real(self.resolve(path)), follow=False)

    def char_device(self, path: str) -> os.stat_result | None:
        st = self.lstat(path)
        return st if st is not None and stat.S_ISCHR(st.st_mode) else None

    def resolve(self, path: str) -> str:
        """Resolve every symlink in `path` inside the root. Missing components are kept as they are."""
        return self.resolve_chain(path)[-1]

    def resolve_chain(self, path: str) -> list[str]:
        """`path`, then each path its final component's symlink chain passes through, ending at the target."""
        chain = [_norm(path)]
        current = self._resolve_parents(chain[0])
        if current != chain[0]:
            chain.append(current)
        for _ in range(_MAX_LINK_HOPS):
            target = self.readlink(current)
            if target is None:
                return chain
            current = self._resolve_parents(posixpath.normpath(posixpath.join(posixpath.dirname(current), target)))
            chain.append(current)
        return chain

    def _resolve_parents(self, path: str) -> str:
        """Resolve links in the directories of `path` (not its last component)."""
        resolved = "/"
        parts = [p for p in path.split("/") if p]
        for index, part in enumerate(parts):
            candidate = posixpath.join(resolved, part)
            if index == len(parts) - 1:
                return candidate
            hops = 0
            target = self.readlink(candidate)
            while target is not None and hops < _MAX_LINK_HOPS:
                candidate = posixpath.normpath(posixpath.join(posixpath.dirname(candidate), target))
                candidate = self._resolve_parents(candidate) if candidate != "/" else candidate
                target = self.readlink(candidate)
                hops += 1
            resolved = candidate
        return resolved

    def glob(self, pattern: str) -> list[str]:
        """Host paths matching a glob (`*`, `?`, `[...]` within a component), sorted."""
        import fnmatch

        matches = ["/"]
        for part in [p for p in pattern.split("/") if p]:
            step: list[str] = []
            for base in matches:
                if any(ch in part for ch in "*?["):
                    step.extend(
                        posixpath.join(base, name)
                        for name in self.listdir(base)
                        if fnmatch.fnmatchcase(name, part)
                    )
                elif self.exists(posixpath.join(base, part)):
                    step.append(posixpath.join(base, part))
            matches = step
        return sorted(matches)
