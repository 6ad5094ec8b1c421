"""The device plugin's metrics (`Metrics`), served with `/healthz` (liveness: the health loop is turning) and
`/readyz` (readiness: every resource is registered with the kubelet there now: 503 while its socket is gone,
nothing listens on it or the kubelet's stream to a resource ended, until the agent registered again) by the
agents' one HTTP server (agent/metricsserver.py: its bounds on what a client may hold).

What the endpoints reveal, to whoever reaches the port, is listed in README.md ("On Kubernetes")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from devinject.agent.metricsserver import MAX_CONNECTIONS as MAX_CONNECTIONS  # re-exported: the server's
from devinject.agent.metricsserver import MAX_REQUEST as MAX_REQUEST
from devinject.agent.metricsserver import REQUEST_DEADLINE as REQUEST_DEADLINE
from devinject.agent.metricsserver import WORKERS as WORKERS
from devinject.agent.metricsserver import WRITE_TIMEOUT as WRITE_TIMEOUT
from devinject.agent.metricsserver import MetricsServer as MetricsServer
from devinject.agent.metricsserver import serve as serve

__all__ = ["MAX_CONNECTIONS", "MAX_REQUEST", "REQUEST_DEADLINE", "WORKERS", "WRITE_TIMEOUT", "Metrics",
           "MetricsServer", "serve"]


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

    def served(self, kind: str, resource: str, healths: tuple[str, ...]) -> None:
        """A kind the agent serves, as `resource`: each of its series exported from now on, at 0 until it counts.
        A counter that first appears at 1 is no increase to Prometheus (`increase()` and `rate()` see a
        series start, not a step), so an alert on a first take-out or refusal would never fire."""
        for health in healths:
            self.devices.labels(kind, health)
        for counter in (self.take_outs, self.put_backs, self.probe_timeouts):
            counter.labels(kind)
        for counter in (self.allocations, self.refusals, self.registrations):
            counter.labels(resource)

    def text(self) -> bytes:
        return generate_latest(self.registry)
