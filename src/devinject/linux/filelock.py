"""An exclusive flock with a deadline: devinject never waits for another writer forever.

A plain class rather than `contextlib`: the hook takes this lock on every container start, and
`contextlib` (with `functools`) costs it a millisecond of imports.
"""

from __future__ import annotations

import fcntl
import os
import time

from devinject.core.errors import DevinjectError
from devinject.linux.trusteddir import trusted_dir


class exclusive:
    """Hold an exclusive lock on `path` (created 0600, never through a link, with its directory when missing;
    a directory others could write, where the lock could be swapped, is refused: linux/trusteddir)."""

    def __init__(self, path: str, *, timeout: float, what: str, error: type[DevinjectError] = DevinjectError) -> None:
        self.path, self.timeout, self.what, self.error = path, timeout, what, error
        self.fd = -1

    def __enter__(self) -> None:
        trusted_dir(os.path.dirname(self.path) or ".", what=f"{self.what} lock's directory", error=self.error)
        try:
            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise self.error(f"{self.path}: cannot open the {self.what} lock: {err.strerror}") from None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise self.error(f"{self.path}: the {self.what} lock was not free within "
                                     f"{self.timeout:g}s") from None
                time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


class NodeLock:
    """A reusable lock shared by this process's threads and by every process on the node that takes `path`:
    `with lock:` waits for both, at most `timeout` s each (two pods of one agent overlap on a node during a
    rolling update, on one state dir). Not reentrant."""

    def __init__(self, path: str, *, timeout: float, what: str, error: type[DevinjectError] = DevinjectError) -> None:
        import threading  # here: the hook imports this module and takes no NodeLock

        self.path, self.timeout, self.what, self.error = path, timeout, what, error
        self.threads = threading.Lock()
        self.held: exclusive | None = None

    def __enter__(self) -> None:
        if not self.threads.acquire(timeout=self.timeout):
            raise self.error(f"{self.path}: the {self.what} lock was not free within {self.timeout:g}s")
        held = exclusive(self.path, timeout=self.timeout, what=self.what, error=self.error)
        try:
            held.__enter__()
        except BaseException:
            self.threads.release()
            raise
        self.held = held

    def __exit__(self, *exc: object) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.__exit__()
        self.threads.release()
