"""`/metrics` scraped by a real Prometheus: Debian's `prometheus` binary (an instance of the test's own on a free
loopback port, never the package's system service) scrapes the real `devinject device-plugin` process, which
serves the HGX H100 fixture to a kubelet-side peer over real unix sockets (fake_kubelet.py), and the test reads
devinject's series back through Prometheus's HTTP API (`/api/v1/targets`, `/api/v1/query`): the devices by
kind and health, the kubelet registrations, and a GPU taken out by a fatal Xid in the agent's kernel log.

A missing prerequisite (the prometheus binary, root for the fixture's copy) fails, never skips."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, terminate
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_device_plugin_log import Agent, _free_port

pytestmark = pytest.mark.live

GPU = "0000:18:00.0"  # the HGX fixture's first GPU
KERNEL_LOG = "var/log/kern.log"  # the agent's default --kernel-log, under --root
WAIT = 30.0  # seconds: bounded so a broken agent or scrape fails, not hangs; nothing asserts a duration
DEVICES = 'devinject_devices{{job="devinject",kind="{kind}",health="{health}"}}'


def _until(condition: Callable[[], object], timeout: float = WAIT) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(0.2)


class Prometheus:
    """Debian's prometheus binary with a config, a TSDB and a listen address of its own (a temp dir and a free
    port on 127.0.0.1), scraping one static target every second."""

    def __init__(self, binary: str, target: str, work: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = work / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: devinject\n    static_configs:\n"
            f"      - targets: ['{target}']\n")
        self.log_path = work / "prometheus.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, cwd=work)

    def text(self) -> str:
        return self.log_path.read_text()

    def get(self, path: str, **params: str) -> dict[str, object]:
        data = self._data(path, params)
        assert isinstance(data, dict), data
        return data

    def get_list(self, path: str, **params: str) -> list[str]:
        data = self._data(path, params)
        assert isinstance(data, list), data
        return data

    def _data(self, path: str, params: dict[str, str]) -> object:
        """The `data` of an API answer whose status is success; a failed one fails the test with its error."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=5) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as err:
            answer = json.load(err)
        assert answer.get("status") == "success", f"{path} {params}: {answer}"
        return answer["data"]

    def ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited {self.process.returncode}:\n{self.text()}"
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def target(self) -> dict[str, object] | None:
        """The devinject job's active target, once Prometheus has one."""
        targets = self.get("/api/v1/targets", state="active")["activeTargets"]
        assert isinstance(targets, list)
        return next((t for t in targets if t.get("labels", {}).get("job") == "devinject"), None)

    def value(self, expr: str) -> float | None:
        """The one sample an instant query answers, or None while it answers none."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        result = data["result"]
        assert isinstance(result, list)
        assert len(result) <= 1, f"{expr}: more than one series: {result}"
        return float(result[0]["value"][1]) if result else None

    def value_is(self, expr: str, expected: float) -> bool:
        return self.value(expr) == expected

    def stop(self) -> None:
        terminate(self.process)
        self.log.close()


def documented_series(doc: str = "docs/deploy.md") -> set[str]:
    """The series a doc tells an admin to scrape (docs/deploy.md, "Metrics": the device plugin's; docs/dra.md:
    the DRA driver's): its table's first column."""
    text = (REPO / doc).read_text()
    return set(re.findall(r"^\| `(devinject_[a-z_]+)` \|", text, re.MULTILINE))


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("live test prerequisite missing: the prometheus binary (Debian's prometheus package: "
                    "make system-deps)")
    return binary


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dpp-", dir="/tmp"))  # a unix socket path has at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prometheus_scrapes_the_agent_and_sees_a_gpu_taken_out(prometheus_binary, host_copy, tmp_path,  # type: ignore[no-untyped-def]
                                                                plugin_dir) -> None:
    host = host_copy("hgx-h100")
    (host / KERNEL_LOG).parent.mkdir(parents=True, exist_ok=True)
    (host / KERNEL_LOG).write_text("[    0.000000] Linux version 6.1.0 (debian-kernel@lists.debian.org)\n")
    (tmp_path / "prometheus").mkdir()
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    agent = Agent(host, plugin_dir, tmp_path)
    prometheus = Prometheus(prometheus_binary, f"127.0.0.1:{agent.port}", tmp_path / "prometheus")
    try:
        assert kubelet.wait_for(lambda: len(kubelet.latest("nvidia.com/gpu") or {}) == 8), agent.text()
        assert _until(prometheus.ready), f"prometheus never ready:\n{prometheus.text()}"

        def up() -> dict[str, object] | None:
            target = prometheus.target()
            return target if target is not None and target.get("health") == "up" else None

        target = _until(up)
        assert target, f"the agent's target never up: {prometheus.target()}\n{prometheus.text()}\n{agent.text()}"
        assert isinstance(target, dict) and target["scrapeUrl"] == f"http://127.0.0.1:{agent.port}/metrics", target
        assert target["lastError"] == "", target
        assert prometheus.value('up{job="devinject"}') == 1

        healthy_gpus = DEVICES.format(kind="nvidia.com/gpu", health="healthy")
        unhealthy_gpus = DEVICES.format(kind="nvidia.com/gpu", health="unhealthy")
        assert _until(lambda: prometheus.value_is(healthy_gpus, 8)), prometheus.value(healthy_gpus)
        assert prometheus.value(DEVICES.format(kind="nvidia.com/rdma", health="healthy")) == 8
        # Every series of a served kind is there from the first scrape, at 0: one that first appears at 1 is no
        # increase to increase() or rate(), and an alert on a first take-out or refusal would never fire.
        take_outs = 'devinject_take_outs_total{job="devinject",kind="nvidia.com/gpu"}'
        for zero in (unhealthy_gpus, take_outs, 'devinject_put_backs_total{kind="nvidia.com/gpu"}',
                     'devinject_probe_timeouts_total{kind="nvidia.com/gpu"}',
                     'devinject_allocate_refusals_total{resource="nvidia.com/gpu"}',
                     'devinject_allocated_devices_total{resource="nvidia.com/gpu"}',
                     DEVICES.format(kind="nvidia.com/rdma", health="unhealthy")):
            assert prometheus.value(zero) == 0, f"{zero}: {prometheus.value(zero)} (no series: None)"
        registrations = 'devinject_kubelet_registrations_total{job="devinject",resource="%s"}'
        for resource in ("nvidia.com/gpu", "nvidia.com/rdma"):
            assert prometheus.value(registrations % resource) == 1, resource  # registered once
        assert len(kubelet.registrations) == 2, kubelet.registrations
        names = prometheus.get_list("/api/v1/label/__name__/values", **{"match[]": '{job="devinject"}'})
        exported = {n for n in names if n.startswith("devinject_") and not n.endswith("_created")}
        assert exported == documented_series(), "docs/deploy.md's series table is not what Prometheus scraped"

        with open(host / KERNEL_LOG, "a") as log:  # as the kernel writes it: the GPU taken out at once
            log.write(f"[ 4242.424242] NVRM: Xid (PCI:{GPU[:-2]}): 79, pid=0, GPU has fallen off the bus.\n")
        assert _until(lambda: prometheus.value_is(healthy_gpus, 7)), \
            f"healthy GPUs in Prometheus: {prometheus.value(healthy_gpus)}\n{agent.text()}"
        assert prometheus.value(unhealthy_gpus) == 1
        assert _until(lambda: prometheus.value_is(take_outs, 1)), prometheus.value(take_outs)
        rise = f"increase({take_outs}[1m]) > 0"  # what an alert on take-outs asks
        assert _until(lambda: prometheus.value(rise)), f"{rise}: no sample; {prometheus.value(take_outs)}"
        assert prometheus.value(DEVICES.format(kind="nvidia.com/rdma", health="healthy")) == 8
        assert (kubelet.latest("nvidia.com/gpu") or {})[GPU][0] == "Unhealthy"
    finally:
        prometheus.stop()
        kubelet.stop()
        text = agent.stop()
    assert agent.process.returncode == 0, text


def test_prometheus_scrapes_the_dra_driver(prometheus_binary, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The DRA driver's /metrics (dra/metrics.py) as a real Prometheus reads it: the driver on the HGX fixture
    with its real DRA socket, the API server's side a stand-in (claims read, slices published), a claim
    prepared and one refused, then unprepared; taints as the health loop records them."""
    from dataclasses import replace

    from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver, prepare, unprepare

    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    Path(dirs["state"]).mkdir(mode=0o755)
    api = FakeApi()
    driver = make_driver(dirs, api)
    port = _free_port()
    driver.opts = replace(driver.opts, metrics_address=f"127.0.0.1:{port}")
    driver.start()
    (tmp_path / "prometheus").mkdir()
    prometheus = Prometheus(prometheus_binary, f"127.0.0.1:{port}", tmp_path / "prometheus")
    series = '{name}{{job="devinject"{labels}}}'

    def value(name: str, labels: str = "") -> float | None:
        return prometheus.value(series.format(name=name, labels=labels))

    try:
        driver.refresh()
        assert _until(prometheus.ready), f"prometheus never ready:\n{prometheus.text()}"
        assert _until(lambda: prometheus.value('up{job="devinject"}') == 1), prometheus.target()
        assert _until(lambda: value("devinject_dra_slice_devices", ',kind="nvidia.com/gpu"') == 8)
        assert value("devinject_dra_slice_publishes_total") == 1
        for reason in ("ledger", "claim", "unknown-device", "api"):  # at 0 from the first scrape
            assert value("devinject_dra_prepare_errors_total", f',reason="{reason}"') == 0, reason
        api.add("good", "uid-good", [(GPU_POOL, "gpu-0000-18-00-0")])
        api.add("bad", "uid-bad", [(GPU_POOL, "gpu-0000-ff-00-0")])
        prepare(driver, ("good", "uid-good"), ("bad", "uid-bad"))
        assert _until(lambda: value("devinject_dra_prepares_total") == 2), value("devinject_dra_prepares_total")
        assert value("devinject_dra_prepare_errors_total", ',reason="unknown-device"') == 1
        assert value("devinject_dra_prepare_duration_seconds_count") == 2
        assert value("devinject_dra_prepared_devices") == 1 and value("devinject_dra_prepared_claims") == 1
        quantile = 'histogram_quantile(0.99, rate(devinject_dra_prepare_duration_seconds_bucket[1m]))'
        assert _until(lambda: prometheus.value(quantile) is not None), quantile  # what a latency alert asks
        driver.metrics.record_taints({"xid": 1})
        assert _until(lambda: value("devinject_dra_device_taints", ',reason="xid"') == 1)
        unprepare(driver, ("good", "uid-good"))
        assert _until(lambda: value("devinject_dra_prepared_devices") == 0)
        assert value("devinject_dra_unprepares_total") == 1
        names = prometheus.get_list("/api/v1/label/__name__/values", **{"match[]": '{job="devinject"}'})
        exported = {re.sub(r"_(bucket|count|sum)$", "", n) if "_duration_seconds_" in n else n
                    for n in names if n.startswith("devinject_") and not n.endswith("_created")}
        assert exported == documented_series("docs/dra.md"), "docs/dra.md's series table is not what was scraped"
    finally:
        prometheus.stop()
        driver.servers.stop()
        if driver.http is not None:
            driver.http.shutdown()
