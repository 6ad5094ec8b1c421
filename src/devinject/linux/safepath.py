"""Resolve container paths inside the rootfs without ever leaving it.

Everything in a container image is hostile: a symlink in the image is followed as if the rootfs were `/`
(absolute targets restart at the rootfs, `..` stops at it), one component at a time with O_NOFOLLOW and
dir fds, so no string path into the rootfs is ever handed to the kernel.
"""

from __future__ import annotations

import errno
import posix  # not `os`, ~0.9 ms of imports: the hook runs this on every container start
import stat

from devinject.core.errors import UnsafePathError

MAX_HOPS = 40
_O_PATH = getattr(posix, "O_PATH", 0o10000000)


class MissingPathError(UnsafePathError):
    """A component of the path is not there (rather than leading out of the root)."""


class Created:
    """What a walk created, so a failed hook can remove it again (deepest first)."""

    def __init__(self) -> None:
        self.dirs: list[tuple[int, str]] = []  # (an fd on the parent, the name made there)

    def close(self) -> None:
        for dir_fd, _ in self.dirs:
            try:
                posix.close(dir_fd)
            except OSError:
                pass
        self.dirs.clear()


class Root:
    """An O_PATH handle on a container rootfs."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Resolved directories by the components asked for: a hook puts many files in the same few
        # directories, and nothing else changes the rootfs while it runs (the container has not started).
        self._dirs: dict[tuple[str, ...], int] = {}
        try:
            self.fd = posix.open(path, _O_PATH | posix.O_DIRECTORY | posix.O_CLOEXEC)
        except OSError as err:
            raise UnsafePathError(f"rootfs {path}: {err.strerror}") from None

    def close(self) -> None:
        for fd in self._dirs.values():
            posix.close(fd)
        self._dirs.clear()
        posix.close(self.fd)

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def walk_parent(self, path: str, *, create: bool = False, created: Created | None = None) -> tuple[int, str]:
        """An fd on the directory that holds `path`'s last component (resolved in-root), and that name.

        The caller owns the returned fd. With `create`, missing directories are made (mode 0755).
        """
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if not parts or parts[-1] == "..":
            raise UnsafePathError(f"{path}: not a file path inside the container")
        last = parts.pop()
        key = tuple(parts)
        cached = self._dirs.get(key)
        if cached is None:
            cached = self._dirs[key] = self._walk(parts, create=create, created=created, path=path)
        return posix.dup(cached), last

    def resolve(self, path: str, *, create_dirs: bool = False, created: Created | None = None) -> tuple[int, str]:
        """Like walk_parent, but the last component's symlinks are followed too (in-root)."""
        hops = 0
        current = path
        while True:
            dir_fd, name = self.walk_parent(current, create=create_dirs, created=created)
            try:
                target = posix.readlink(name, dir_fd=dir_fd)
            except OSError:
                return dir_fd, name
            hops += 1
            if hops > MAX_HOPS:
                posix.close(dir_fd)
                raise UnsafePathError(f"{path}: too many symlinks")
            parent = self.relative_dir(dir_fd)
            posix.close(dir_fd)
            current = target if target.startswith("/") else f"{parent}/{target}"

    def open_dir(self, path: str) -> int | None:
        """A readable fd on the container's directory `path` (links followed in-root), for listing; None when
        it is not there or not a directory. The caller closes it."""
        try:
            parent_fd, name = self.resolve(path)
        except UnsafePathError:
            return None
        try:
            return posix.open(name, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_NOFOLLOW | posix.O_CLOEXEC,
                              dir_fd=parent_fd)
        except OSError:
            return None
        finally:
            posix.close(parent_fd)

    def relative_dir(self, dir_fd: int) -> str:
        """The in-root path of a directory fd (for re-walking a relative link target)."""
        real = posix.readlink(f"/proc/self/fd/{dir_fd}")
        base = posix.readlink(f"/proc/self/fd/{self.fd}")
        if real == base:
            return "/"
        if not real.startswith(base.rstrip("/") + "/"):
            raise UnsafePathError(f"{real}: outside the rootfs {base}")
        return real[len(base.rstrip("/")):]

    def _walk(self, parts: list[str], *, create: bool, created: Created | None, path: str) -> int:
        stack = [posix.dup(self.fd)]
        pending = list(parts)
        hops = 0
        try:
            while pending:
                part = pending.pop(0)
                if part in ("", "."):
                    continue
                if part == "..":
                    if len(stack) > 1:
                        posix.close(stack.pop())
                    continue
                try:
                    fd = posix.open(part, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=stack[-1])
                except FileNotFoundError:
                    if not create:
                        raise MissingPathError(f"{path}: {part} does not exist in the container") from None
                    try:
                        posix.mkdir(part, 0o755, dir_fd=stack[-1])
                    except FileExistsError:
                        pass  # made meanwhile (another container's hook on a shared rootfs): not ours to undo
                    else:
                        if created is not None:
                            created.dirs.append((posix.dup(stack[-1]), part))
                    fd = posix.open(part, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=stack[-1])
                st = posix.fstat(fd)
                if stat.S_ISLNK(st.st_mode):
                    target = posix.readlink(part, dir_fd=stack[-1])
                    posix.close(fd)
                    hops += 1
                    if hops > MAX_HOPS:
                        raise UnsafePathError(f"{path}: too many symlinks")
                    if target.startswith("/"):
                        while len(stack) > 1:
                            posix.close(stack.pop())
                    pending = [p for p in target.split("/") if p] + pending
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    posix.close(fd)
                    raise UnsafePathError(f"{path}: {part} is not a directory in the container")
                stack.append(fd)
            result = stack.pop()
            return result
        except OSError as err:
            raise UnsafePathError(f"{path}: {posix.strerror(err.errno or errno.EIO)}") from None
        finally:
            for fd in stack:
                posix.close(fd)
