"""The node agent's `/metrics` server under a hostile client, live on 127.0.0.1: a flood of half-sent requests
pins neither threads nor connections and a scrape is still answered; a client that trickles its request is
dropped after a few seconds; an oversized request is refused; a bare `devinject device-plugin` listens on
loopback only. Every loop here is bounded and stops by itself."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from devinject import cli
from devinject.deviceplugin import metrics as metrics_module
from devinject.deviceplugin.metrics import Metrics, serve

# What the server promises (the module's constants may be tighter, never looser).
DROPPED_WITHIN = 5.0  # seconds: a client that has not sent its whole request head by then is gone
AT_MOST_OPEN = 64  # connections the server keeps open whatever the clients do
AT_MOST_THREADS = 8  # threads the server may add, whatever the clients do
FLOOD = 300
HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: node\r\n"  # no blank line: the head never ends


@pytest.fixture
def port() -> Iterator[int]:
    metrics = Metrics()
    metrics.devices.labels("nvidia.com/gpu", "healthy").set(8)
    server = serve("127.0.0.1:0", metrics, lambda: True, lambda: True)
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def finished(sock: socket.socket) -> bool:
    """The server is done with this connection: it answered or closed it (we never read, so either shows)."""
    return bool(select.select([sock], [], [], 0)[0])


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_a_flood_of_half_sent_requests_pins_nothing_and_a_scrape_is_still_answered(port: int) -> None:
    threads_before = threading.active_count()
    clients: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            client = connect(port)
            client.sendall(HALF_SENT)
            clients.append(client)
        time.sleep(0.5)  # let the server take them all in
        assert threading.active_count() - threads_before <= AT_MOST_THREADS
        still_open = sum(not finished(c) for c in clients)
        assert still_open <= AT_MOST_OPEN, f"{still_open} of {FLOOD} half-sent requests still held open"

        status, text = scrape(port)  # while the flood is connected
        assert status == 200 and 'devinject_devices{health="healthy",kind="nvidia.com/gpu"} 8.0' in text
        assert scrape(port, "/healthz")[0] == 200

        give_up = time.monotonic() + DROPPED_WITHIN + 1
        while time.monotonic() < give_up and not all(finished(c) for c in clients):
            time.sleep(0.1)
        assert all(finished(c) for c in clients), "half-sent requests still held open after the deadline"
        assert threading.active_count() - threads_before <= AT_MOST_THREADS
    finally:
        for client in clients:
            client.close()


def test_a_client_that_trickles_its_request_is_dropped_after_the_deadline(port: int) -> None:
    with connect(port) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        start = time.monotonic()
        dropped_after = None
        while time.monotonic() - start < 2 * DROPPED_WITHIN:  # one byte every 0.2 s: no read ever waits long
            if finished(client):
                dropped_after = time.monotonic() - start
                break
            try:
                client.sendall(b"a")
            except OSError:
                dropped_after = time.monotonic() - start
                break
            time.sleep(0.2)
    assert dropped_after is not None, f"a trickling client was still connected after {2 * DROPPED_WITHIN:g}s"
    assert 1.0 <= dropped_after <= DROPPED_WITHIN, dropped_after  # a few seconds: not at once, not never
    assert scrape(port)[0] == 200


def test_an_oversized_request_is_refused(port: int) -> None:
    with connect(port) as client:
        try:
            client.sendall(b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n")
            answer = client.recv(4096)
        except ConnectionResetError:
            answer = b""  # closed with our bytes unread: refused all the same
    assert not answer.startswith(b"HTTP/1.0 200"), "a 20 KB request head was served"
    assert answer == b"" or answer.startswith(b"HTTP/1.0 431 ")
    assert scrape(port)[0] == 200


def test_connections_beyond_the_bound_push_out_the_oldest_half_sent_one(port: int) -> None:
    """The bound holds for connections that are held open without any data at all, too."""
    clients = [connect(port) for _ in range(AT_MOST_OPEN + 16)]
    try:
        time.sleep(0.5)
        assert sum(not finished(c) for c in clients) <= AT_MOST_OPEN
        assert finished(clients[0]) and not finished(clients[-1])  # the oldest went first
        assert scrape(port)[0] == 200
    finally:
        for client in clients:
            client.close()


def test_an_ipv6_node_address_is_served() -> None:
    """The DaemonSet binds `$(NODE_IP):9400`; on an IPv6 node that is `fd00::1:9400`."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = serve("::1:0", Metrics(), lambda: True, lambda: True)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://[::1]:{port}/healthz", timeout=5) as response:
            assert response.status == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_bare_device_plugin_listens_on_loopback_only() -> None:
    params = cli.cli.commands["device-plugin"].make_context("device-plugin", []).params
    assert params["metrics_address"] == "127.0.0.1:9400"


def test_the_module_constants_keep_the_promises() -> None:
    assert metrics_module.REQUEST_DEADLINE < DROPPED_WITHIN and metrics_module.WRITE_TIMEOUT <= DROPPED_WITHIN
    assert metrics_module.MAX_CONNECTIONS <= AT_MOST_OPEN and metrics_module.WORKERS + 1 <= AT_MOST_THREADS
