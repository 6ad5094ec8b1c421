"""The DRA driver's /metrics (dra/metrics.py), read from the driver's own HTTP endpoint while the kubelet's
side prepares and unprepares claims over the real DRA socket: counts, durations, errors by reason, prepared
devices, slices published and their errors, taints by reason; /healthz and /readyz."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devinject.core.errors import DevinjectError
from devinject.dra.driver import DraDriver
from devinject.dra.kubeapi import ApiError
from devinject.dra.metrics import ERROR_REASONS, DraMetrics, error_reason
from devinject.dra.publisher import PublishError
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver, prepare, unprepare


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(devinject_dra_[^ ]+) ([^ ]+)", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def status(url: str, path: str) -> int:
    try:
        with urllib.request.urlopen(url + path, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


class FlakyApi(FakeApi):
    """The API server refusing to publish while `failing` holds an error, and claims it does not answer."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: Exception | None = None

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        if self.failing is not None:
            raise self.failing
        return super().publish(desired)

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if name == "unanswered":
            raise ApiError(f"GET claim {namespace}/{name}: connection refused", 0, "connection refused")
        return super().get_claim(namespace, name)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[DraDriver, FlakyApi, str]]:
    api = FlakyApi()
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    Path(dirs["state"]).mkdir(mode=0o755)
    driver = make_driver(dirs, api)
    driver.opts = replace(driver.opts, metrics_address="127.0.0.1:0")
    driver.start()
    driver.refresh()
    assert driver.metrics_bound is not None
    try:
        yield driver, api, f"http://{driver.metrics_bound}"
    finally:
        driver.servers.stop()
        assert driver.http is not None
        driver.http.shutdown()


def test_prepares_unprepares_and_their_errors_are_counted(served):
    driver, api, url = served
    before = scrape(url)
    assert before["devinject_dra_prepares_total"] == 0 and before["devinject_dra_prepared_devices"] == 0
    assert all(before[f'devinject_dra_prepare_errors_total{{reason="{r}"}}'] == 0 for r in ERROR_REASONS)
    api.add("good", "uid-good", [(GPU_POOL, "gpu-0000-18-00-0"), (GPU_POOL, "gpu-0000-2a-00-0")])
    api.add("bad", "uid-bad", [(GPU_POOL, "gpu-0000-ff-00-0")])
    api.add("stale", "uid-other", [(GPU_POOL, "gpu-0000-5d-00-0")])
    answer = prepare(driver, ("good", "uid-good"), ("bad", "uid-bad"), ("stale", "uid-stale"),
                     ("unanswered", "uid-unanswered"))
    assert answer.claims["uid-good"].error == "" and answer.claims["uid-bad"].error
    got = scrape(url)
    assert got["devinject_dra_prepares_total"] == 4
    assert got['devinject_dra_prepare_errors_total{reason="unknown-device"}'] == 1
    assert got['devinject_dra_prepare_errors_total{reason="claim"}'] == 1  # the API's uid is another claim's
    assert got['devinject_dra_prepare_errors_total{reason="api"}'] == 1
    assert got["devinject_dra_prepare_duration_seconds_count"] == 4
    assert got["devinject_dra_prepared_claims"] == 1 and got["devinject_dra_prepared_devices"] == 2
    unprepare(driver, ("good", "uid-good"))
    got = scrape(url)
    assert got["devinject_dra_unprepares_total"] == 1 and got["devinject_dra_unprepare_duration_seconds_count"] == 1
    assert got["devinject_dra_prepared_claims"] == 0 and got["devinject_dra_prepared_devices"] == 0
    assert sum(v for k, v in got.items() if k.startswith("devinject_dra_unprepare_errors_total")) == 0


def test_slices_published_and_publish_errors_by_reason(served):
    driver, api, url = served
    got = scrape(url)
    assert got["devinject_dra_slice_publishes_total"] == 1  # at start
    assert got['devinject_dra_slice_devices{kind="nvidia.com/gpu"}'] == 8
    driver.published = None  # something to publish again
    api.failing = PublishError("ResourceSlice node1-gpu: 403 Forbidden")
    api.failing.__context__ = ApiError("PUT slice: 403 Forbidden", 403)
    with pytest.raises(DevinjectError):
        driver.refresh()
    driver.metrics.publish_failed(api.failing)  # what the loop does with the error
    api.failing = ApiError("PUT slice: connection refused", 0)
    driver.metrics.publish_failed(api.failing)
    got = scrape(url)
    assert got['devinject_dra_slice_publish_errors_total{reason="api-403"}'] == 1
    assert got['devinject_dra_slice_publish_errors_total{reason="unreachable"}'] == 1
    assert got['devinject_dra_slice_publish_errors_total{reason="other"}'] == 0


def test_taints_by_reason_are_what_the_health_loop_records(served):
    driver, _, url = served
    assert not any(k.startswith("devinject_dra_device_taints") for k in scrape(url))
    driver.metrics.record_taints({"xid": 2, "unbound": 1})
    got = scrape(url)
    taints = 'devinject_dra_device_taints{{reason="{}"}}'
    assert got[taints.format("xid")] == 2 and got[taints.format("unbound")] == 1
    driver.metrics.record_taints({"xid": 1})
    got = scrape(url)
    assert got[taints.format("xid")] == 1 and got[taints.format("unbound")] == 0


def test_healthz_and_readyz(served):
    driver, _, url = served
    assert status(url, "/healthz") == 200
    assert status(url, "/readyz") == 503  # no kubelet registered the driver here
    driver.servers.registration.registered.set()
    assert status(url, "/readyz") == 200
    assert status(url, "/nothing") == 404


def test_error_reasons_are_bounded():
    from devinject.core.errors import LedgerError
    from devinject.dra.claims import CheckpointError, PrepareError

    try:
        try:
            raise LedgerError("device c 195:0 is held by container abc")
        except LedgerError as inner:
            raise PrepareError(f"claim a/b: {inner.message}") from None
    except PrepareError as wrapped:
        assert error_reason(wrapped) == "ledger"
    assert error_reason(CheckpointError("x: corrupt checkpoint")) == "checkpoint"
    assert error_reason(PrepareError("x: cannot write the claim's CDI spec: No space left")) == "cdi-spec"
    assert error_reason(PrepareError("anything a pod user wrote")) == "other"
    assert DraMetrics().text().count(b"devinject_dra_prepare_errors_total{") == len(ERROR_REASONS)
