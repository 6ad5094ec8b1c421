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


KERNEL_SOURCES = ("auto", "kmsg", "journal")  # --kernel-log words that are no file (agent/kernelmsg.py)
_JOURNAL_DIRS = ("var/log/journal", "run/log/journal")
_JOURNALCTL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _kmsg_readable(root: str) -> bool:
    try:
        fd = os.open(os.path.join(root, "dev/kmsg"), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False  # EPERM: dmesg_restrict without CAP_SYSLOG, or a device cgroup that denies it
    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def journal_under(root: str) -> str | None:
    """The journal directory under `root` that holds anything (persistent first), or None."""
    for directory in _JOURNAL_DIRS:
        try:
            with os.scandir(os.path.join(root, directory)) as entries:
                if any(entries):
                    return os.path.join(root, directory)
        except OSError:
            continue
    return None


def _journal_readable(directory: str) -> bool:
    """Whether this process may read one of the journal's files (a reader without it sees no entries and
    journalctl still exits 0: the silent "healthy" this module exists to stop)."""
    found = False
    try:
        with os.scandir(directory) as machines:
            subdirs = [m.path for m in machines if m.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    for machine in subdirs:
        try:
            with os.scandir(machine) as entries:
                files = [e.path for e in entries if e.name.endswith((".journal", ".journal~"))]
        except OSError:
            continue
        found = found or bool(files)
        if any(os.access(path, os.R_OK) for path in files):
            return True
    return not found


def auto_kernel_source(root: str) -> str:
    """What `--kernel-log auto` reads under `root`: `kmsg` when /dev/kmsg opens (a char device), else
    `journal` when there is one and journalctl to read it, else `file` (/var/log/kern.log)."""
    import shutil

    if _kmsg_readable(root):
        return "kmsg"
    if journal_under(root) is not None and shutil.which("journalctl", path=_JOURNALCTL_PATH):
        return "journal"
    return "file"


def _kernel_source(source: str, root: str, default_file: str) -> None:
    """`kmsg` must open; `journal` needs journalctl; `auto` that falls back to the file checks the file."""
    import shutil

    if source == "kmsg" and not _kmsg_readable(root):
        path = os.path.join(root, "dev/kmsg")
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY))
            why = "not a character device"
        except OSError as err:
            why = _why(err) if err.errno != errno.ENOENT else "no such device"
            if err.errno in (errno.EACCES, errno.EPERM):
                why += ": reading it needs CAP_SYSLOG where kernel.dmesg_restrict is 1"
        raise UsageError(f"--kernel-log kmsg: {path}: {why}")
    if source == "journal" and not shutil.which("journalctl", path=_JOURNALCTL_PATH):
        raise UsageError("--kernel-log journal: journalctl is not installed (PATH /usr/bin:/bin)")
    if source in ("journal", "auto") and (source == "journal" or auto_kernel_source(root) == "journal"):
        directory = journal_under(root)
        if directory is not None and not _journal_readable(directory):
            raise UsageError(f"--kernel-log {source}: {directory}: no journal file is readable (uid "
                              f"{os.geteuid()}; the journal's group, systemd-journal or adm, may read it)")
    if source == "auto" and auto_kernel_source(root) == "file":
        _kernel_log(default_file, root, explicit=False)


def check_roots(*, root: str | None = None, profile_dirs: tuple[str, ...] = (), state_dir: str | None = None,
                kernel_log: str | None = None, kernel_log_explicit: bool = False) -> None:
    """Raise UsageError, in one line naming the option and path, for the first root that is wrong."""
    if root is not None:
        _directory("--root", root)
    for directory in profile_dirs:
        _directory("--profile-dir", directory)
    if state_dir is not None:
        _directory("--state-dir", state_dir, absent_ok=True)
    if kernel_log in KERNEL_SOURCES:
        from devinject.core.paths import DEFAULT_KERNEL_LOG

        _kernel_source(kernel_log, root or "/", DEFAULT_KERNEL_LOG)
    elif kernel_log is not None:
        _kernel_log(kernel_log, root or "/", explicit=kernel_log_explicit)
