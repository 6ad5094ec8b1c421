"""Reading a pipe to its end within one deadline for the whole read (a writer that drips a byte at a time
does not get a fresh timeout per chunk), and within a size cap. Lean: the hook uses it."""

from __future__ import annotations

import os
import select
import time


class TooLarge(Exception):
    """More than the cap was written."""


def read_to_eof(fd: int, seconds: float, limit: int) -> bytes:
    """Everything on `fd` until EOF. TimeoutError when `seconds` pass first; TooLarge past `limit` bytes."""
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    size = 0
    while True:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError(f"no end of input within {seconds:g}s")
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"more than {limit} bytes")
        chunks.append(chunk)
