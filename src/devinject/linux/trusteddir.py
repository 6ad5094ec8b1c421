"""Where root writes: a directory devinject keeps state or logs in is created with an explicit mode and
refused when anyone but its owner could change what is in it; a log is appended to without following a link.

Whatever the caller's umask (a shell, a misconfigured unit), what devinject makes gets the mode it names;
a directory others can write (or that is a link, or someone else's) is refused with one line naming it, for
the hook reads the ledger, health verdicts and cached facts from there as root. Lean: the hook uses it.
"""

from __future__ import annotations

import errno
import os
import stat

from devinject.core.errors import DevinjectError

DIR_MODE = 0o755
FILE_MODE = 0o644
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # no FIFO hangs


def make_dirs(path: str, mode: int = DIR_MODE) -> None:
    """`mkdir -p`, every directory it makes in exactly `mode` (mkdir applies the umask, so each is fixed
    through an fd: never a chmod through a name someone could swap)."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and not os.path.lexists(parent):
        make_dirs(parent, mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if os.path.isdir(path):
            return  # another writer made it first: checked like any existing one
        raise
    fd = os.open(path, _DIR)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def dir_problem(st: os.stat_result) -> str | None:
    """Why a directory (lstat) cannot hold root's files: only its owner, root or this user, may change it."""
    if not stat.S_ISDIR(st.st_mode):
        return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def trusted_dir(path: str, mode: int = DIR_MODE, *, what: str = "state directory",
                error: type[DevinjectError] = DevinjectError) -> str:
    """`path`, created (with missing parents) in `mode` when absent, else checked: a real directory (never
    a link), owned by root or this user, writable by nobody else. Anything else raises `error` in one line."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            make_dirs(path, mode)
            st = os.lstat(path)
        except OSError as err:
            raise error(f"{path}: cannot create the {what}: {err.strerror}") from None
    except OSError as err:
        raise error(f"{path}: cannot check the {what}: {err.strerror}") from None
    problem = dir_problem(st)
    if problem:
        raise error(f"{path}: the {what} {problem}; refused (devinject keeps root's files there)")
    return path


def open_append(path: str, mode: int = FILE_MODE) -> int:
    """An append-only fd on the regular file `path` (created in exactly `mode`), never through a link: a
    symbolic link at `path` is not followed, and a FIFO, a device, a hard link to another file or someone
    else's file is refused. Raises OSError (its strerror says why)."""
    try:
        fd = os.open(path, _APPEND, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file")
        if st.st_nlink != 1:
            raise OSError(errno.EMLINK, "has other hard links")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"is owned by uid {st.st_uid}")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # created under a umask, or by an older devinject under umask 0
    except BaseException:
        os.close(fd)
        raise
    return fd


def append(path: str, data: bytes, mode: int = FILE_MODE, *, max_size: int | None = None) -> bool:
    """Append `data` to `path` (through open_append); False, with nothing written, when the file would grow
    past `max_size`. Raises OSError."""
    fd = open_append(path, mode)
    try:
        if max_size is not None and os.fstat(fd).st_size + len(data) > max_size:
            return False
        os.write(fd, data)
        return True
    finally:
        os.close(fd)
