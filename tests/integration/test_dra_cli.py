"""`devinject dra-driver` as a process: its sockets answer the kubelet while the API server is unreachable
(the publisher says so in one line per round and keeps trying), SIGTERM stops it and removes its sockets,
and bad options are one line naming them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.conftest import HOSTS

DEVINJECT = str(Path(sys.executable).parent / "devinject")
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def args(tmp_path: Path, *extra: str) -> list[str]:
    return [DEVINJECT, "dra-driver", "--host-root", str(HOSTS / "hgx-h100"), "--node-name", "node1",
            "--state-dir", str(tmp_path / "state"), "--cdi-dir", str(tmp_path / "cdi"),
            "--plugin-dir", str(tmp_path / "plugins"), "--registry-dir", str(tmp_path / "registry"),
            "--hook-path", "/usr/bin/devinject", "--rescan", "0.5", *extra]


def test_serves_the_kubelet_without_the_api_server_and_stops_cleanly(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    (tmp_path / "state").mkdir(mode=0o755)
    log = tmp_path / "log"
    with open(log, "wb") as out:
        process = subprocess.Popen(args(tmp_path, "--kubeconfig", str(kubeconfig)), stdout=out, stderr=out)
    registration = tmp_path / "registry" / "dra.devinject.io-reg.sock"
    try:
        deadline = time.monotonic() + 20
        while not registration.exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with grpc.insecure_channel(f"unix://{registration}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)  # type: ignore[no-untyped-call]
        assert info.endpoint == str(tmp_path / "plugins" / "dra.devinject.io" / "dra.sock")
        deadline = time.monotonic() + 30
        while log.read_text().count("publishing ResourceSlices:") < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(20)
    text = log.read_text()
    assert code == 0, text
    assert "list resourceslices:" in text and "Traceback" not in text
    assert not registration.exists() and not os.path.exists(info.endpoint)


def test_bad_options_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir(mode=0o755)
    done = subprocess.run(args(tmp_path, "--kubeconfig", str(tmp_path / "absent")), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "absent" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run(args(tmp_path, "--driver-name", "Not.Lower"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # a usage error (a bad option value), not a runtime failure
    assert done.stderr.strip().splitlines() == ["devinject: error: --driver-name 'Not.Lower': must be lower case "
                                                "(a DNS subdomain)"]


def test_a_metrics_port_in_use_fails_the_start_before_any_socket_is_made(tmp_path: Path) -> None:
    """A second driver on a node whose metrics port is taken stops in one line, leaving no registration socket
    behind for the kubelet to find dead (it made its sockets first and left them)."""
    (tmp_path / "state").mkdir(mode=0o755)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(args(tmp_path, "--kubeconfig", str(kubeconfig), "--metrics-address", address),
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [f"devinject: error: --metrics-address {address}: cannot listen: "
                                                "Address already in use"]
    assert not any((tmp_path / "registry").glob("*.sock")) and not any((tmp_path / "plugins").rglob("*.sock"))
