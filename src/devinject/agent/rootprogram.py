"""A program under the host's (or the driver's) root that devinject runs as root: `nvidia-smi`,
`nvidia-cuda-mps-control`. It is found as the host would find it, resolved inside that root (an absolute link,
Debian's `/usr/bin/nvidia-smi -> /etc/alternatives/nvidia-smi`, restarts at the root, never at the agent's own
image; `..` stops at it), and it must pass the check specs and hooks pass (cdi/spec.py's trust_problem): the
file and every directory from the root down to it root's and writable by nobody else, so what runs is what
root put there, and nobody else can swap it between the check and the exec."""

from __future__ import annotations

import os
import stat

from devinject.cdi.spec import trust_problem
from devinject.core.errors import DevinjectError, UnsafePathError
from devinject.linux.safepath import MissingPathError, Root


class UntrustedProgramError(DevinjectError):
    """A program that is there but is not run: said in one line naming it."""


def root_program(root: str, path: str) -> str | None:
    """Where `path` (absolute inside `root`) resolves to, as a path here, when it is an executable regular file
    that root alone can change; None when it is not there. UntrustedProgramError (one line) for anything
    else: a path leading out of the root, not a file, not executable, someone else's or writable by others."""
    named = os.path.join(root, path.lstrip("/"))
    try:
        with Root(root) as tree:
            parent_fd, name = tree.resolve(path)
            try:
                inside = tree.relative_dir(parent_fd)
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            finally:
                os.close(parent_fd)
    except MissingPathError:
        return None
    except FileNotFoundError:
        return None
    except UnsafePathError as err:
        raise UntrustedProgramError(f"{named}: {err.message}; not run") from None
    except OSError as err:
        raise UntrustedProgramError(f"{named}: {err.strerror}; not run") from None
    found = os.path.join(root, inside.lstrip("/"), name)
    shown = named if found == named else f"{named} (-> {found})"
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        raise UntrustedProgramError(f"{shown}: not an executable file; not run")
    problem = trust_problem(st)
    if problem:
        raise UntrustedProgramError(f"{shown}: {problem}; refused (it would run as root)")
    directory = os.path.dirname(found)
    while True:  # every directory down to it: one someone else could change could swap the program
        try:
            problem = trust_problem(os.lstat(directory), directory=True)
        except OSError as err:
            raise UntrustedProgramError(f"{directory}: {err.strerror}; {shown} not run") from None
        if problem:
            raise UntrustedProgramError(f"{directory}: directory {problem}; {shown} refused (it would run as "
                                        "root)")
        if os.path.normpath(directory) == os.path.normpath(root) or directory in ("/", ""):
            return found
        directory = os.path.dirname(directory)
