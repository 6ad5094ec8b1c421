"""The node agents' HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (liveness) and `/readyz`
(readiness), each answered from what the agent gives (`serve`): the device plugin's (deviceplugin/metrics.py) and
the DRA driver's (dra/metrics.py) alike.

The listener faces the node's network (the DaemonSets bind the node's address), so a client gets a bounded
share of it: one thread reads every request head without blocking; a head must arrive whole within
`REQUEST_DEADLINE` and within `MAX_REQUEST` bytes, or the connection is dropped (431 for an oversized one);
at most `MAX_CONNECTIONS` are open at once, and a new one beyond that pushes out the oldest still sending its
head (none left to push out: 503 at once). Complete requests go to `WORKERS` threads, whose answers must be
sent within `WRITE_TIMEOUT`. A half-sent request therefore pins no thread, and a scrape that sends its
request at once is answered whatever else is connected."""

from __future__ import annotations

import errno
import io
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from devinject.core.errors import DevinjectError

log = logging.getLogger(__name__)

REQUEST_DEADLINE = 3.0  # seconds from accept for the whole request head
WRITE_TIMEOUT = 3.0  # seconds to send an answer
MAX_CONNECTIONS = 32  # open at once: heads being read plus requests being answered
MAX_REQUEST = 8192  # bytes of request head (a scrape's is ~200)
WORKERS = 2
_ACCEPTS_PER_ROUND = MAX_CONNECTIONS // 2  # so a connection accepted in a round is read before it can be pushed out
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")



class Scrapeable(Protocol):
    def text(self) -> bytes: ...


class _SocketWriter(io.BufferedIOBase):
    """The handler's `wfile`: every write is sent whole (within the socket's timeout) or raises."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sock.sendall(data)
        return len(memoryview(data))


class _Handler(BaseHTTPRequestHandler):
    """One request whose head was already read: `request` is `(socket, head)`."""

    metrics: Scrapeable
    alive: Callable[[], bool]
    ready: Callable[[], bool]

    def setup(self) -> None:
        self.connection, head = self.request
        self.connection.settimeout(WRITE_TIMEOUT)
        self.rfile = io.BytesIO(head)
        self.wfile = _SocketWriter(self.connection)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, self.metrics.text(), CONTENT_TYPE_LATEST)
        elif self.path in ("/healthz", "/readyz"):
            ok = self.alive() if self.path == "/healthz" else self.ready()
            self._send(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # probes every few seconds: not worth a log line


def _refuse(sock: socket.socket, status: str) -> None:
    """A short answer to a connection we will not serve, never blocking (an empty send buffer takes it)."""
    try:
        sock.setblocking(False)
        sock.send(f"HTTP/1.0 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    except OSError:
        pass
    sock.close()


class _Pending:
    __slots__ = ("deadline", "head")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.head = bytearray()


class MetricsServer:
    """The listener, its reading thread and its workers; `shutdown()` stops them and closes every socket."""

    def __init__(self, listener: socket.socket, handler: type[_Handler]) -> None:
        self.listener = listener
        self.handler = handler
        self.server_address: tuple[str, int] = listener.getsockname()[:2]
        self.selector = selectors.DefaultSelector()
        self.pending: dict[socket.socket, _Pending] = {}  # in accept order: the first is the oldest
        self.busy = 0  # requests handed to the workers and not finished
        self.busy_lock = threading.Lock()
        self.workers = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="metrics-worker")
        self.stopping = threading.Event()
        self.wake_r, self.wake_w = socket.socketpair()
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._loop, name="metrics", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.stopping.set()
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(timeout=5)
        self.workers.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        self.shutdown()

    # --- the reading thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                wait = min((p.deadline for p in self.pending.values()), default=now + 1.0) - now
                events = self.selector.select(max(0.0, min(wait, 1.0)))
                # Heads first, then new connections: one that sent its request at once is never pushed out.
                for key, _ in events:
                    if key.fileobj not in (self.listener, self.wake_r):
                        self._read(key.fileobj)  # type: ignore[arg-type]
                if any(key.fileobj is self.listener for key, _ in events):
                    self._accept()
                self._expire(time.monotonic())
        except Exception:  # the endpoints must not die silently with the agent still running
            log.exception("metrics server")
        finally:
            for sock in list(self.pending):
                self._drop(sock)
            self.selector.close()
            self.listener.close()
            self.wake_r.close()
            self.wake_w.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors, a reset before accept: the next round retries
                log.debug("metrics accept: %s", err)
                return
            with self.busy_lock:
                full = len(self.pending) + self.busy >= MAX_CONNECTIONS
            if full and self.pending:
                self._drop(next(iter(self.pending)))  # the oldest still sending its head
            elif full:
                _refuse(sock, "503 Service Unavailable")
                continue
            sock.setblocking(False)
            self.pending[sock] = _Pending(time.monotonic() + REQUEST_DEADLINE)
            self.selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        pending = self.pending.get(sock)
        if pending is None:
            return
        try:
            data = sock.recv(MAX_REQUEST + 1 - len(pending.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        pending.head += data
        if any(end in pending.head for end in _HEAD_ENDS):
            self.selector.unregister(sock)
            del self.pending[sock]
            with self.busy_lock:
                self.busy += 1
            self.workers.submit(self._answer, sock, bytes(pending.head))
        elif len(pending.head) > MAX_REQUEST:
            self.selector.unregister(sock)
            del self.pending[sock]
            _refuse(sock, "431 Request Header Fields Too Large")

    def _expire(self, now: float) -> None:
        for sock, pending in list(self.pending.items()):
            if pending.deadline > now:
                break  # accept order is deadline order
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        del self.pending[sock]
        sock.close()

    # --- the workers -----------------------------------------------------------------------------------
    def _answer(self, sock: socket.socket, head: bytes) -> None:
        try:
            sock.setblocking(True)
            self.handler((sock, head), sock.getpeername(), self)  # type: ignore[arg-type]
        except OSError as err:  # the client went away or stopped reading
            log.debug("metrics answer: %s", err)
        except Exception:
            log.exception("metrics answer")
        finally:
            sock.close()
            with self.busy_lock:
                self.busy -= 1


def _listen(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted agent rebinds at once
        listener.bind((host or "0.0.0.0", int(port)))
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    return listener


def _handler(metrics: Scrapeable, alive: Callable[[], bool], ready: Callable[[], bool]) -> type[_Handler]:
    return type("Handler", (_Handler,), {"metrics": metrics, "alive": staticmethod(alive),
                                         "ready": staticmethod(ready)})


def serve(address: str, metrics: Scrapeable, alive: Callable[[], bool], ready: Callable[[], bool]) -> MetricsServer:
    """Start the endpoints on `host:port` (an IPv6 host bare or in brackets; an empty one: every address)
    in daemon threads; the server is returned so it can be shut down."""
    try:
        listener = _listen(address)
    except OSError as err:
        raise DevinjectError(f"--metrics-address {address}: cannot listen: {err.strerror or err}") from None
    return MetricsServer(listener, _handler(metrics, alive, ready))


class WaitingMetricsServer:
    """The endpoints on an address another process holds now: during a rolling update the pod being replaced
    holds the agents' port in the node's network, so the new pod binds it as soon as that pod lets it go
    (tried every `retry` s) and serves its sockets meanwhile. `shutdown()` stops the trying too."""

    def __init__(self, address: str, handler: type[_Handler], retry: float) -> None:
        self.address, self.handler, self.retry = address, handler, retry
        self.server: MetricsServer | None = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._bind, name="metrics-wait", daemon=True).start()

    @property
    def server_address(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)

    def _bind(self) -> None:
        while not self.stopped.wait(self.retry):
            try:
                listener = _listen(self.address)
            except OSError:
                continue
            with self.lock:
                if self.stopped.is_set():
                    listener.close()
                    return
                self.server = MetricsServer(listener, self.handler)
            log.info("metrics: listening on %s now that it is free", self.address)
            return

    def shutdown(self) -> None:
        with self.lock:
            self.stopped.set()
            server, self.server = self.server, None
        if server is not None:
            server.shutdown()


def serve_or_wait(address: str, metrics: Scrapeable, alive: Callable[[], bool], ready: Callable[[], bool],
                  retry: float = 1.0) -> MetricsServer | WaitingMetricsServer:
    """`serve`, except that an address in use is waited for (WaitingMetricsServer) rather than an error: for an
    agent in a pod, whose predecessor on the node may still hold the port while both overlap."""
    try:
        listener = _listen(address)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise DevinjectError(f"--metrics-address {address}: cannot listen: {err.strerror or err}") from None
        log.warning("metrics: %s is in use (the pod this one replaces, during a rolling update?): listening "
                    "there once it is free", address)
        return WaitingMetricsServer(address, _handler(metrics, alive, ready), retry)
    return MetricsServer(listener, _handler(metrics, alive, ready))
