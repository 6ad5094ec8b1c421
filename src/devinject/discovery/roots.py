"""The directories and files a command is pointed at, checked once before it reads or writes anything.

A typo'd `--root` must not read as a node without devices (a health probe would call it healthy), a
`--profile-dir` that is not there must not be skipped, and a `--state-dir` that is a file must not be ignored.
Each problem is one UsageError (exit 2) naming the option and the path. What is merely absent by default is fine: the
root's own profiles.d, a state directory not yet made (it must be creatable), the default kernel log. What is
there but may not be read is an error wherever it is, default or not: reading it as absent is the silent lie
this module exists to stop.
"""

from __future__ import annotations

import errno
import os
import stat

from devinject.core.errors import UsageError


def _why(err: OSError) -> str:
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied (uid {os.geteuid()})"
    if err.errno == errno.ENOENT:
        return "no such directory"
    if err.errno == errno.ENOTDIR:
        return "not a directory"
    return err.strerror or str(err)


def _directory(option: str, path: str, *, absent_ok: bool = False) -> None:
    """`path` opens as a directory this process may read; with `absent_ok`, a missing one whose nearest
    existing ancestor is a directory (so that it can be made) passes too."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        return
    except OSError as err:
        if not (absent_ok and err.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.lexists(path)):
            raise UsageError(f"{option} {path}: {_why(err)}") from None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: cannot be created: {parent} is not a directory")


def _kernel_log(path: str, root: str, *, explicit: bool) -> None:
    """The kernel log as health reads it (under the root): missing is an error only when it was asked for;
    unreadable, or not a file, always is. Opened without blocking, so a FIFO cannot hang the check."""
    from devinject.discovery.host import Host

    host = Host(root)
    real = host.real(host.resolve(path))
    where = "" if host.root == "/" else f" (under --root: {real})"
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR) and not explicit:
            return
        why = "no such file" if err.errno in (errno.ENOENT, errno.ENOTDIR) else _why(err)
        raise UsageError(f"--kernel-log {path}: {why}{where}") from None
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise UsageError(f"--kernel-log {path}: is a directory{where}")
    finally:
        os.close(fd)


def check_roots(*, root: str | None = None, profile_dirs: tuple[str, ...] = (), state_dir: str | None = None,
                kernel_log: str | None = None, kernel_log_explicit: bool = False) -> None:
    """Raise UsageError, in one line naming the option and path, for the first root that is wrong."""
    if root is not None:
        _directory("--root", root)
    for directory in profile_dirs:
        _directory("--profile-dir", directory)
    if state_dir is not None:
        _directory("--state-dir", state_dir, absent_ok=True)
    if kernel_log is not None:
        _kernel_log(kernel_log, root or "/", explicit=kernel_log_explicit)
