"""The DRA driver's metrics, served on `--metrics-address` with `/healthz` and `/readyz` by the agents' one
HTTP server (agent/metricsserver.py, as the device plugin's):

The series, their labels and what each counts are in docs/dra.md ("Metrics"). `record_taints` is the hook
the health loop calls with the devices it taints per reason.

Every labelled series that has a known label set (each error reason, each taint reason named once) is
exported at 0 from the start: a counter that first appears at 1 is no increase to Prometheus."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from devinject.core.errors import DevinjectError, LedgerError
from devinject.nodestate.claimcheckpoints import ClaimRecord

# why a claim was not prepared (or unprepared): a bounded set, so that a label never grows with the input
ERROR_REASONS = ("checkpoint", "ledger", "claim", "api", "unknown-device", "cdi-spec", "deadline", "other")
PUBLISH_REASONS = ("unreachable", "other")  # and api-<status> for each HTTP status seen
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def error_reason(err: BaseException) -> str:
    """The `reason` label of a prepare or unprepare that failed (one of ERROR_REASONS), from the error's type
    and what it wraps; never the message itself (unbounded, and the claim's)."""
    from devinject.dra.claims import CheckpointError
    from devinject.dra.kubeapi import ApiError

    context = err.__cause__ or err.__context__
    if isinstance(err, CheckpointError):
        return "checkpoint"
    if isinstance(err, LedgerError) or isinstance(context, LedgerError):
        return "ledger"
    if isinstance(err, ApiError) or isinstance(context, ApiError):
        return "api"
    message = err.message if isinstance(err, DevinjectError) else str(err)
    if "not one this node" in message:
        return "unknown-device"
    if "CDI spec" in message:
        return "cdi-spec"
    if "status.allocation" in message or "the API has uid" in message or "opaque" in message:
        return "claim"
    return "other"


def publish_reason(err: BaseException) -> str:
    """`api-<status>` for an answer the API server gave, `unreachable` for none, else `other`."""
    from devinject.dra.kubeapi import ApiError

    for cause in (err, err.__cause__, err.__context__):
        if isinstance(cause, ApiError):
            return f"api-{cause.status}" if cause.status else "unreachable"
    return "other"


class DraMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prepares = Counter("devinject_dra_prepares", "Claims NodePrepareResources asked for", registry=r)
        self.prepare_errors = Counter("devinject_dra_prepare_errors", "Claims not prepared, by reason", ["reason"],
                                      registry=r)
        self.prepare_seconds = Histogram("devinject_dra_prepare_duration_seconds", "One claim's prepare",
                                         buckets=DURATION_BUCKETS, registry=r)
        self.unprepares = Counter("devinject_dra_unprepares", "Claims NodeUnprepareResources asked for", registry=r)
        self.unprepare_errors = Counter("devinject_dra_unprepare_errors", "Claims not unprepared, by reason",
                                        ["reason"], registry=r)
        self.unprepare_seconds = Histogram("devinject_dra_unprepare_duration_seconds", "One claim's unprepare",
                                           buckets=DURATION_BUCKETS, registry=r)
        self.prepared_claims = Gauge("devinject_dra_prepared_claims", "Claims prepared on this node now",
                                     registry=r)
        self.prepared_devices = Gauge("devinject_dra_prepared_devices",
                                      "Devices of the claims prepared on this node now", registry=r)
        self.publishes = Counter("devinject_dra_slice_publishes", "ResourceSlice sets published", registry=r)
        self.publish_errors = Counter("devinject_dra_slice_publish_errors", "Rounds whose publishing failed",
                                      ["reason"], registry=r)
        self.slice_devices = Gauge("devinject_dra_slice_devices", "Devices in the node's ResourceSlices", ["kind"],
                                   registry=r)
        self.taints = Gauge("devinject_dra_device_taints", "Devices tainted now, by the taint's reason", ["reason"],
                            registry=r)
        for reason in ERROR_REASONS:
            self.prepare_errors.labels(reason)
            self.unprepare_errors.labels(reason)
        for reason in PUBLISH_REASONS:
            self.publish_errors.labels(reason)
        self._kinds: set[str] = set()
        self._taint_reasons: set[str] = set()

    def watch_prepared(self, prepared: Callable[[], Mapping[str, ClaimRecord]]) -> None:
        """Read the prepared claims (the checkpoint: `Preparer.prepared`) at each scrape; NaN when it cannot
        be read (the driver says why in its log)."""
        def claims() -> float:
            try:
                return float(len(prepared()))
            except (DevinjectError, OSError):
                return math.nan

        def devices() -> float:
            try:
                return float(sum(len(record.devices) for record in prepared().values()))
            except (DevinjectError, OSError, TypeError):
                return math.nan

        self.prepared_claims.set_function(claims)
        self.prepared_devices.set_function(devices)

    def published(self, per_kind: Mapping[str, int]) -> None:
        """The slices just published: their devices per kind (a kind no longer offered drops to 0)."""
        self.publishes.inc()
        for kind in self._kinds | set(per_kind):
            self.slice_devices.labels(kind).set(per_kind.get(kind, 0))
        self._kinds |= set(per_kind)

    def publish_failed(self, err: BaseException) -> None:
        self.publish_errors.labels(publish_reason(err)).inc()

    def record_taints(self, reasons: Mapping[str, int]) -> None:
        """The devices tainted now, per taint reason (`xid`, `aer-fatal`, `unbound`, `link`, ...): the health
        loop calls this whenever the taints it publishes change. A reason it named before and not now is 0."""
        for reason in self._taint_reasons | set(reasons):
            self.taints.labels(reason).set(reasons.get(reason, 0))
        self._taint_reasons |= set(reasons)

    def text(self) -> bytes:
        return generate_latest(self.registry)
