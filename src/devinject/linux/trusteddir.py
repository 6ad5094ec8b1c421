"""Where root writes: every directory and file devinject makes is created in an explicit mode, and every
directory it writes into is refused when anyone but root (or this user) could change what is in it, along
the whole path; a log is appended to without following a link.

Whatever the caller's umask (a shell, a misconfigured unit), what devinject makes gets the mode it names;
a directory others can write (or that is a link, or someone else's), or one under such a directory, is
refused with one line naming it: the hook reads the ledger, health verdicts and cached facts from there as
root, and a runtime's drop-in there is code it runs as root. A sticky directory others can write (/tmp) is
passed through as the kernel would let it be: only its entries owned by root or this user. `write_file` and
`remove_file` write root's files anywhere (a runtime's config, a hooks.d file, a unit, a claim's spec); in a
directory `trusted_dir` checked (the state dir) its owner writes through core/atomicfile. Lean: the hook uses it.
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


_MAX_LINKS = 40  # the kernel's own limit on links followed in one path


def _trusted_uids() -> tuple[int, int]:
    return 0, os.geteuid()


def ancestor_problem(path: str) -> tuple[str, str] | None:
    """The first directory above `path` that someone else could change (and why), or None: each one, links
    followed as the kernel does, owned by root or this user and writable by nobody else, except a sticky one,
    whose entries on the way must then be root's or this user's (the kernel lets only an entry's owner, or
    the directory's, rename or remove it). What does not exist yet is not checked: it is ours to make."""
    trusted = _trusted_uids()
    todo = [p for p in reversed(os.path.abspath(path).split("/")[:-1]) if p]  # popped from the end
    current, links = "/", 0
    st = os.lstat("/")
    while True:
        problem = dir_problem(st)
        if problem and not _sticky_ok(st):
            return current, problem
        sticky = problem is not None  # its entries on the way must be root's or this user's
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":  # current is resolved: its parent was checked on the way here
                current = os.path.dirname(current)
                break
            entry = os.path.join(current, name)
            try:
                st = os.lstat(entry)
            except FileNotFoundError:
                return None
            if sticky and st.st_uid not in trusted:
                return entry, f"is owned by uid {st.st_uid} in the sticky directory {current}"
            if not stat.S_ISLNK(st.st_mode):
                current = entry
                break
            links += 1
            if links > _MAX_LINKS:
                return entry, "has too many levels of symbolic links"
            target = os.readlink(entry)
            todo.extend(p for p in reversed(target.split("/")) if p)
            if target.startswith("/"):
                current = "/"
                break
        else:
            return None
        st = os.lstat(current)


def _sticky_ok(st: os.stat_result) -> bool:
    """A directory others may write that the kernel guards as /tmp: sticky, and root's or this user's."""
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX) and st.st_uid in _trusted_uids()


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
    a link), owned by root or this user, writable by nobody else, and every directory above it one only root
    or this user could change (ancestor_problem). Anything else raises `error` in one line."""
    _checked_dir(path, mode, what, error, probe=path, follow=False)
    return path


def _checked_dir(path: str, mode: int, what: str, error: type[DevinjectError], *, probe: str,
                 follow: bool) -> None:
    """trusted_dir's work: the directories above `probe` checked (ancestor_problem), `path` made when missing
    and checked again, then `path` itself (through a link when `follow`, else a link is refused)."""
    _check_ancestors(probe, what, error, path)
    look = os.stat if follow else os.lstat
    try:
        st = look(path)
    except FileNotFoundError:
        try:
            make_dirs(path, mode)
            st = look(path)
        except OSError as err:
            raise error(f"{path}: cannot create the {what}: {err.strerror}") from None
        _check_ancestors(probe, what, error, path)  # what another writer made first on the way is checked too
    except OSError as err:
        raise error(f"{path}: cannot check the {what}: {err.strerror}") from None
    problem = dir_problem(st)
    if problem:
        raise error(f"{path}: the {what} {problem}; refused (devinject keeps root's files there)")


def _check_ancestors(path: str, what: str, error: type[DevinjectError], named: str | None = None) -> None:
    """ancestor_problem(path) as one line: the directory at fault, above the `what` at `named` (`path`)."""
    named = named or path
    try:
        found = ancestor_problem(path)
    except OSError as err:
        raise error(f"{named}: cannot check the {what}'s path: {err.strerror}") from None
    if found:
        where, problem = found
        if where == named:  # the directory itself (reached through a link)
            raise error(f"{where}: the {what} {problem}; refused (devinject keeps root's files there)")
        raise error(f"{where}: {problem}, above the {what} {named}; refused (devinject keeps root's files there)")


def write_file(path: str, data: bytes, mode: int | None = 0o644, *, what: str = "file",
               error: type[DevinjectError] = DevinjectError, dir_mode: int = DIR_MODE, sync: bool = False) -> None:
    """Replace `path` with `data` (core/atomicfile: readers see the old file or the new one) as root writes:
    its directory made in `dir_mode` when missing, else checked as trusted_dir does; a file already there
    must be root's or this user's. The new file gets `mode` whatever the umask (None: the existing file's
    mode less write for group and others and set-id bits, 0644 for a new one). Anything else raises `error`
    in one line naming the path, with nothing written."""
    from devinject.core.atomicfile import replace

    _file_dir(path, what, error, dir_mode)
    st = _existing(path, what, error)
    if mode is None:
        mode = stat.S_IMODE(st.st_mode) & 0o1755 if st is not None and stat.S_ISREG(st.st_mode) else FILE_MODE
    try:
        replace(path, data, mode, sync=sync)
    except OSError as err:
        raise error(f"{path}: cannot write the {what}: {err.strerror}") from None


def remove_file(path: str, *, what: str = "file", error: type[DevinjectError] = DevinjectError) -> bool:
    """Remove `path` (never through a link) from a directory checked as write_file checks it; False when it
    was not there."""
    if not os.path.exists(os.path.dirname(os.path.abspath(path))):
        return False
    _file_dir(path, what, error)
    if _existing(path, what, error) is None:
        return False
    try:
        os.unlink(path)
    except OSError as err:
        raise error(f"{path}: cannot remove the {what}: {err.strerror}") from None
    return True


def _file_dir(path: str, what: str, error: type[DevinjectError], mode: int = DIR_MODE) -> None:
    """The directory `path` goes in, made in `mode` when missing, else checked: the whole way to it (links
    followed as the kernel does, its own name included: /etc/containerd may be a link of root's) root's
    alone, and itself writable by nobody else, sticky or not."""
    directory = os.path.dirname(os.path.abspath(path))
    _checked_dir(directory, mode, f"directory of the {what}", error, probe=path, follow=True)


def _existing(path: str, what: str, error: type[DevinjectError]) -> os.stat_result | None:
    """The lstat of `path` when there, refused when it is someone else's or a directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise error(f"{path}: cannot check the {what}: {err.strerror}") from None
    if st.st_uid not in _trusted_uids():
        raise error(f"{path}: the {what} is owned by uid {st.st_uid}; refused (devinject keeps root's files there)")
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: the {what} is a directory; refused")
    return st


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
