"""Read-only access to a host's files under a root directory (`/` in production, a fixture tree in tests).

Paths given to and returned by `Host` are host-view paths (`/sys/bus/pci/devices`); `Host.real()` maps one
onto the real filesystem. Symlinks are resolved by `Host.resolve()` as if `root` were `/`: an absolute link
target is re-rooted, never followed onto the machine running the tests.
"""

from __future__ import annotations

import os
import posixpath
import stat

_MAX_LINK_HOPS = 40


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
        """File contents, or None when it is missing or unreadable."""
        try:
            with open(self.real(self.resolve(path)), encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return None

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with open(self.real(self.resolve(path)), "rb") as handle:
                return handle.read()
        except OSError:
            return None

    def read_attr(self, path: str) -> str | None:
        """A sysfs attribute: contents without the trailing newline the kernel always prints."""
        text = self.read_text(path)
        return None if text is None else text.strip()

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.real(self.resolve(path))))
        except OSError:
            return []

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.real(self.resolve(path)))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self.real(self.resolve(path)))

    def is_link(self, path: str) -> bool:
        return os.path.islink(self.real(path))

    def readlink(self, path: str) -> str | None:
        try:
            return self._links[path]
        except KeyError:
            pass
        try:
            target: str | None = os.readlink(self.real(path))
        except OSError:
            target = None
        self._links[path] = target
        return target

    def lstat(self, path: str) -> os.stat_result | None:
        try:
            return os.lstat(self.real(self.resolve(path)))
        except OSError:
            return None

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
