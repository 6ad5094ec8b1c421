"""An exclusive flock with a deadline: devinject never waits for another writer forever."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from devinject.errors import DevinjectError


@contextlib.contextmanager
def exclusive(path: str, *, timeout: float, what: str, error: type[DevinjectError] = DevinjectError) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created, with its directory, when missing)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise error(f"{path}: cannot open the {what} lock: {err.strerror}") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise error(f"{path}: the {what} lock was not free within {timeout:g}s") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)
