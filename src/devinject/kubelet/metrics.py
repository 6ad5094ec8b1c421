"""The node agent's HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (liveness: the health
loop is turning) and `/readyz` (readiness: every resource is registered with the kubelet)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from devinject.core.errors import DevinjectError


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.devices = Gauge("devinject_devices", "Devices offered, by kind and health", ["kind", "health"],
                             registry=self.registry)
        self.allocations = Counter("devinject_allocated_devices", "Devices handed out by Allocate", ["resource"],
                                   registry=self.registry)
        self.refusals = Counter("devinject_allocate_refusals", "Allocate requests refused", ["resource"],
                                registry=self.registry)
        self.take_outs = Counter("devinject_take_outs", "Devices taken out as unhealthy", ["kind"],
                                 registry=self.registry)
        self.put_backs = Counter("devinject_put_backs", "Devices put back as healthy again", ["kind"],
                                 registry=self.registry)
        self.probe_timeouts = Counter("devinject_probe_timeouts", "Health probes that did not answer in time",
                                      ["kind"], registry=self.registry)
        self.registrations = Counter("devinject_kubelet_registrations", "Registrations with the kubelet",
                                     ["resource"], registry=self.registry)
        self.hook_latency = Gauge("devinject_hook_duration_ms",
                                  "The devinject hook's newest prestart duration on this node (from its log)",
                                  registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def serve(address: str, metrics: Metrics, alive: Callable[[], bool], ready: Callable[[], bool]) -> ThreadingHTTPServer:
    """Start the endpoints on `host:port` in a daemon thread; the server is returned so it can be shut down."""
    host, _, port = address.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, metrics.text(), CONTENT_TYPE_LATEST)
            elif self.path in ("/healthz", "/readyz"):
                ok = alive() if self.path == "/healthz" else ready()
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

    try:
        server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
    except OSError as err:
        raise DevinjectError(f"--metrics-address {address}: cannot listen: {err.strerror}") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
