"""What `kubectl logs` shows: the real `devinject device-plugin` process at its default verbosity, against a
kubelet-side peer over real unix sockets (fake_kubelet.py), in the same process or in one of its own that can
die the way a kubelet does (SIGKILL: its socket file stays, nothing listens on it). The agent's stderr must
say, one plain line each, what it does; `/readyz` must follow the kubelet."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devinject.deviceplugin import agent as agent_module
from tests.e2e.conftest import terminate
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_device_plugin import GPU_PATH, start_agent

DEVINJECT = str(Path(sys.executable).parent / "devinject")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _until(condition: Callable[[], object], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


class Agent:
    """`devinject device-plugin` as the DaemonSet runs it (no -v), its stderr in a file."""

    def __init__(self, host: Path, plugin_dir: Path, work: Path) -> None:
        self.port = _free_port()
        self.err_path = work / "agent.err"
        self.err = open(self.err_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [DEVINJECT, "device-plugin", "--root", str(host), "--plugin-dir", str(plugin_dir),
             "--state-dir", str(work / "state"), "--output-dir", str(work / "cdi"), "--test-timings",
             "--interval", "0.2", "--recheck", "0.1", "--threshold", "2", "--no-uevents",
             "--metrics-address", f"127.0.0.1:{self.port}", "--hook-path", "/usr/bin/devinject"],
            stdout=subprocess.DEVNULL, stderr=self.err)

    def text(self) -> str:
        return self.err_path.read_text()

    def lines(self, pattern: str) -> list[str]:
        return [line for line in self.text().splitlines() if re.search(pattern, line)]

    def said(self, pattern: str, count: int = 1, timeout: float = 15.0) -> list[str]:
        assert _until(lambda: len(self.lines(pattern)) >= count, timeout), \
            f"no {count} line(s) matching {pattern!r} in:\n{self.text()}"
        return self.lines(pattern)

    def readyz(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except OSError:
            return 0

    def stop(self) -> str:
        terminate(self.process)
        self.err.close()
        return self.text()


class KubeletProcess:
    """The fake kubelet in a process of its own, so it can be killed as a crashing kubelet is."""

    def __init__(self, plugin_dir: Path) -> None:
        code = textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(REPO)!r})
            from tests.integration.fake_kubelet import FakeKubelet
            FakeKubelet({str(plugin_dir)!r}).start()
            print("up", flush=True)
            while True:
                time.sleep(1)
        """)
        self.process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline() == "up\n"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dpl-", dir="/tmp"))  # a unix socket path has at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _plain(text: str) -> None:
    """Every line is one plain line of devinject's: no JSON, no traceback."""
    for line in text.splitlines():
        assert line.startswith("devinject: "), f"not a devinject line: {line!r}\n{text}"
        assert "{" not in line and "Traceback" not in line, line


def test_a_life_of_the_agent_is_in_its_log_at_default_verbosity(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    host = host_copy("hgx-h100")
    agent = Agent(host, plugin_dir, tmp_path)
    kubelet = FakeKubelet(str(plugin_dir))
    try:
        started = agent.said(r"device plugin on node ")[0]
        assert "nvidia.com/gpu 8" in started and "nvidia.com/rdma" in started, started
        assert str(tmp_path / "cdi") in started and str(tmp_path / "state") in started
        assert f"127.0.0.1:{agent.port}" in started
        socket_path = str(plugin_dir / "kubelet.sock")
        waiting = agent.said("waiting for the kubelet socket")
        assert socket_path in waiting[0]
        time.sleep(3)  # three polls or more: said once, not on every poll
        assert len(agent.lines("waiting for the kubelet")) == 1, agent.text()
        assert agent.readyz() == 503

        kubelet.start()
        for resource in ("nvidia.com/gpu", "nvidia.com/rdma"):
            line = agent.said(rf"^devinject: INFO: {re.escape(resource)}: registered with the kubelet")[0]
            assert re.search(r"\d+\.\d\d s after the kubelet socket appeared", line), line
        assert _until(lambda: agent.readyz() == 200)

        (host / GPU_PATH / "enable").write_text("0\n")  # the driver lets go of the GPU: taken out
        assert _until(lambda: (kubelet.latest("nvidia.com/gpu") or {}).get("0000:18:00.0", ("",))[0] == "Unhealthy")
        agent.said(r"nvidia.com/gpu: ListAndWatch: 0000:18:00.0 Unhealthy")
        taken = agent.said(r"taking out .*0000:18:00.0")[0]  # watch's line: the device and the reason
        assert "enable" in taken, taken
        (host / GPU_PATH / "enable").write_text("1\n")
        agent.said(r"nvidia.com/gpu: ListAndWatch: 0000:18:00.0 Healthy")

        from devinject.deviceplugin.api import v1beta1_pb2 as api

        kubelet.plugins["nvidia.com/gpu"].stub.Allocate(api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=["0000:2a:00.0", "0000:3a:00.0"]),
            api.ContainerAllocateRequest(devices_ids=["0000:db:00.0"])]), timeout=5)
        allocated = agent.said(r"nvidia.com/gpu: Allocate")[0]
        assert "0000:2a:00.0" in allocated and "0000:db:00.0" in allocated and "2 containers" in allocated

        kubelet.stop()  # the kubelet goes: its socket removed
        assert _until(lambda: agent.readyz() == 503)
        assert socket_path in agent.said("kubelet socket .* is gone")[0]
        kubelet.start()
        again = agent.said(r"nvidia.com/gpu: registered again with the kubelet")
        assert re.search(r"\d+\.\d\d s after the kubelet socket appeared", again[0]), again
        assert _until(lambda: agent.readyz() == 200)

        before = len(agent.lines(r"nvidia.com/gpu: registered again"))
        kubelet.stop()
        kubelet.start()  # a kubelet restart: a new socket at once, our sockets removed
        agent.said("kubelet restarted")
        agent.said(r"nvidia.com/gpu: registered again with the kubelet", before + 1)
        assert _until(lambda: agent.readyz() == 200)
    finally:
        kubelet.stop()
        text = agent.stop()
    assert agent.process.returncode == 0, text
    assert text.splitlines()[-1].startswith("devinject: INFO: stopped"), text
    _plain(text)


def test_ready_follows_a_kubelet_that_dies_leaving_its_socket(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    """A kubelet killed leaves kubelet.sock behind (nothing listens on it) and breaks the ListAndWatch streams:
    the agent is not ready until a kubelet is back and it registered again."""
    kubelet = KubeletProcess(plugin_dir)
    agent = Agent(host_copy("hgx-h100"), plugin_dir, tmp_path)
    try:
        assert _until(lambda: agent.readyz() == 200), agent.text()
        kubelet.kill()
        assert (plugin_dir / "kubelet.sock").exists()
        assert _until(lambda: agent.readyz() == 503), agent.text()
        agent.said(r"nvidia.com/rdma: registered with the kubelet")
        agent.said(r"nvidia.com/gpu: registered with the kubelet")
        agent.said(r"nvidia.com/gpu: the kubelet's ListAndWatch stream ended")
        agent.said(r"nothing listens on .*kubelet.sock")
        time.sleep(2)
        assert agent.readyz() == 503 and len(agent.lines("nothing listens on")) == 1, agent.text()
        kubelet = KubeletProcess(plugin_dir)  # back: a new socket in place of the dead one
        agent.said(r"nvidia.com/gpu: registered again with the kubelet")
        agent.said(r"nvidia.com/rdma: registered again with the kubelet")
        assert _until(lambda: agent.readyz() == 200), agent.text()
    finally:
        kubelet.kill()
        text = agent.stop()
    _plain(text)


def test_a_stream_the_kubelet_closes_means_register_again(host_copy, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    agent = Agent(host_copy("hgx-h100"), plugin_dir, tmp_path)
    try:
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu"))
        count = len(kubelet.registrations)
        kubelet.plugins["nvidia.com/gpu"].channel.close()  # the kubelet drops the plugin's stream
        agent.said(r"nvidia.com/gpu: the kubelet's ListAndWatch stream ended")
        agent.said(r"nvidia.com/gpu: registered again with the kubelet .* after its ListAndWatch stream ended")
        assert kubelet.wait_for(lambda: len(kubelet.registrations) > count)
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu"))
        assert _until(lambda: agent.readyz() == 200)
    finally:
        kubelet.stop()
        text = agent.stop()
    _plain(text)


def test_the_waiting_line_comes_back_every_so_often_not_every_poll(host_copy, tmp_path, plugin_dir, monkeypatch,  # type: ignore[no-untyped-def]
                                                                  caplog) -> None:
    monkeypatch.setattr(agent_module, "WAIT_LOG_EVERY", 0.6)  # 30 s in the agent; the poll here is 0.2 s

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "waiting for the kubelet socket" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="devinject"):
        running = start_agent(host_copy("hgx-h100"), plugin_dir, tmp_path)
        try:
            assert _until(said)
            time.sleep(2.1)
        finally:
            running.stop.set()
            running.thread.join(timeout=10)
    assert 3 <= len(said()) <= 5, said()  # at 0, 0.6, 1.2, 1.8 s: not the ten polls
    assert said()[0].startswith("waiting for the kubelet socket " + str(plugin_dir / "kubelet.sock"))
    assert all(m.startswith("still waiting") for m in said()[1:]), said()
    assert os.path.exists(plugin_dir) and not os.path.exists(plugin_dir / "kubelet.sock")


def test_registration_survives_a_closed_stream_while_stopping(host_copy, tmp_path, plugin_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    """Shutting down ends the streams: not taken for a kubelet gone (no warning, no attempt to register)."""
    kubelet = FakeKubelet(str(plugin_dir))
    kubelet.start()
    with caplog.at_level(logging.INFO, logger="devinject"):
        running = start_agent(host_copy("hgx-h100"), plugin_dir, tmp_path)
        try:
            assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") and kubelet.latest("nvidia.com/rdma"))
        finally:
            running.stop.set()
            running.thread.join(timeout=10)
            kubelet.stop()
    assert not [r for r in caplog.records if "stream ended" in r.getMessage()], caplog.text
