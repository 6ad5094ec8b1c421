"""One wall-clock deadline for a whole answer, however its sender drips it (a fresh timeout per read lets a
byte every 1.5 s hold the reader forever): a pipe read to its end within a size cap (`read_to_eof`), and a
socket shut down when its deadline passes (`SocketDeadline`: every answer from a server, the API server's and
the DRA driver's /metrics alike, connect to last byte, status line, headers and chunk sizes included).
Lean: the hook uses it (socket and threading are imported by SocketDeadline alone)."""

from __future__ import annotations

import posix  # not `os`, ~0.9 ms of imports: the hook runs this on every container start
import select
import time

TYPE_CHECKING = False  # `typing` is a module too (the hook reads this one): type checkers only

if TYPE_CHECKING:
    import socket
    import threading


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
        chunk = posix.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"more than {limit} bytes")
        chunks.append(chunk)


class SocketDeadline:
    """One wall-clock deadline for an exchange with a server: `left()` for the connect's timeout, then
    `arm(sock)` once connected; when the deadline passes, the socket is shut down (through a duplicate of its
    descriptor, so a TLS layer is left alone), which ends any read or write blocked on it, wherever in the
    answer it is. `expired` says so afterwards: what was read before it is not the whole answer."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.at = seconds, time.monotonic() + seconds
        self.expired = False
        self._socket: socket.socket | None = None
        self._timer: threading.Timer | None = None

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("deadline passed")
        return left

    def passed(self) -> bool:
        """The deadline has passed (the watchdog fired, or the time is up with no watchdog armed yet)."""
        return self.expired or time.monotonic() >= self.at

    def arm(self, sock: socket.socket) -> None:
        import socket
        import threading

        # a duplicate of the descriptor (an SSLSocket has no dup(): a kept connection is armed again)
        self._socket = socket.socket(sock.family, sock.type, sock.proto, posix.dup(sock.fileno()))
        self._timer = threading.Timer(self.left(), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        import socket

        self.expired = True
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.disarm()

    def disarm(self) -> None:
        """The watchdog stopped and its duplicate descriptor closed (it may be armed again)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
