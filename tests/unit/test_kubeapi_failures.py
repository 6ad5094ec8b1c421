"""The DRA driver's API client (dra/kubeapi.py) against local fake servers that misbehave as API servers and
networks do: a server trickling a byte every 2 s, a huge answer, 429/5xx with and without Retry-After,
dropped connections, a rotated token file, a service account's token, KUBECONFIG lists, kubeconfig users with
credential plugins, client certificate data (no file written), and a watch."""

from __future__ import annotations

import base64
import json
import os
import resource
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devinject.dra import kubeapi
from devinject.dra.kubeapi import ApiError, ResourceApi, credentials
from tests.unit.test_kubeapi import certs  # noqa: F401 - the module's self-signed 127.0.0.1 certificate


class Request:
    def __init__(self, line: str, headers: dict[str, str]) -> None:
        self.line, self.headers = line, headers


class FakeServer:
    """A TLS server on loopback: each connection's request is read, then `handler(n, request, socket)` writes
    whatever it likes (n counts connections from 0)."""

    def __init__(self, pki: Path, handler: Callable[[int, Request, ssl.SSLSocket], None], port: int = 0) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(pki / "server.crt", pki / "server.key")
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        count = 0
        while not self.stopped:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(count, raw), daemon=True).start()
            count += 1

    def _one(self, number: int, raw: socket.socket) -> None:
        try:
            conn = self.context.wrap_socket(raw, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head = data.split(b"\r\n\r\n")[0].decode().split("\r\n")
            request = Request(head[0], {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])})
            self.requests.append(request)
            self.handler(number, request, conn)
            conn.close()
        except OSError:
            pass
        finally:
            raw.close()

    def close(self) -> None:
        self.stopped = True
        self.listener.close()


def answer(conn: ssl.SSLSocket, status: int, body: object, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n{extra}\r\n".encode() + data)


@pytest.fixture
def serve(certs: Path) -> Iterator[Callable[[Callable[[int, Request, ssl.SSLSocket], None]], FakeServer]]:  # noqa: F811
    servers: list[FakeServer] = []

    def start(handler: Callable[[int, Request, ssl.SSLSocket], None]) -> FakeServer:
        servers.append(FakeServer(certs, handler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def kubeconfig(path: Path, port: int, ca: Path, user: dict[str, Any] | None = None, name: str = "u") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "certificate-authority-data":
                                                   base64.b64encode(ca.read_bytes()).decode()}}],
        "users": [{"name": name, "user": user or {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": name}}]}))
    return path


def client(tmp_path: Path, server: FakeServer, certs: Path, **api: Any) -> ResourceApi:  # noqa: F811
    return ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server.port, certs / "server.crt"))), **api)


# --- one wall-clock deadline per call -----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["status line", "body"])
def test_a_server_trickling_a_byte_every_2s_does_not_hold_a_call_past_its_deadline(
        tmp_path: Path, serve: Any, certs: Path, where: str) -> None:  # noqa: F811
    body = json.dumps({"kind": "ResourceClaim", "metadata": {"name": "c"}}).encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()

    def trickle(_: int, __: Request, conn: ssl.SSLSocket) -> None:
        data = head + body if where == "status line" else body
        if where == "body":
            conn.sendall(head)
        for byte in data[:12]:  # 24 s of it at most: each read gets a byte well within a 3 s socket timeout
            conn.sendall(bytes([byte]))
            time.sleep(2)

    server = serve(trickle)
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server.port, certs / "server.crt"))), timeout=3)
    api.budget = 0  # one attempt
    started = time.monotonic()
    with pytest.raises(ApiError, match="no answer within 3 s"):
        api.read_namespaced_resource_claim("c", "ns")
    assert time.monotonic() - started < 4.5


# --- a cap on an answer's size ------------------------------------------------------------------------------
def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("declared", [True, False])
def test_a_huge_answer_is_refused_without_the_memory_growing(
        tmp_path: Path, serve: Any, certs: Path, declared: bool) -> None:  # noqa: F811
    size, block = 300 << 20, b" " * (1 << 20)

    def huge(_: int, __: Request, conn: ssl.SSLSocket) -> None:
        length = f"Content-Length: {size}\r\n" if declared else ""
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}Connection: close\r\n\r\n"
                     .encode() + b"{\"items\": [")
        for _ in range(size // len(block)):
            conn.sendall(block)

    server = serve(huge)
    api = client(tmp_path, server, certs)
    api.max_answer = 4 << 20
    before = _peak_mib()
    with pytest.raises(ApiError, match="more than 4194304"):
        api.list_resource_slice(field_selector="x")
    assert _peak_mib() - before < 64


# --- retries, backoff, Retry-After ----------------------------------------------------------------------------
def test_429_and_5xx_are_tried_again_waiting_what_retry_after_asks(
        tmp_path: Path, serve: Any, certs: Path) -> None:  # noqa: F811
    script = [(429, {"Retry-After": "2"}), (503, {}), (500, {"Retry-After": "1"}), (200, {})]

    def flaky(n: int, __: Request, conn: ssl.SSLSocket) -> None:
        status, headers = script[n]
        answer(conn, status, {"kind": "Status", "message": "busy"} if status != 200 else {"items": []}, headers)

    server = serve(flaky)
    waits: list[float] = []
    api = client(tmp_path, server, certs, sleep=waits.append)
    assert api.list_resource_slice(field_selector="x") == {"items": []}
    assert len(server.requests) == 4 and len(waits) == 3
    assert waits[0] >= 2 and waits[2] >= 1  # Retry-After honoured
    assert 0 <= waits[1] <= kubeapi.BACKOFF_FIRST * 2  # exponential backoff with jitter in between


def test_backoff_grows_exponentially_with_jitter_and_ends_within_the_budget(
        tmp_path: Path, serve: Any, certs: Path) -> None:  # noqa: F811
    server = serve(lambda n, r, conn: answer(conn, 503, {"message": "down"}))
    waits: list[float] = []
    clock = [0.0]

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock[0] += seconds

    api = client(tmp_path, server, certs, sleep=sleep, budget=0.0)
    real = time.monotonic
    kubeapi.time.monotonic = lambda: real() + clock[0]  # type: ignore[attr-defined]
    try:
        api.budget = 20.0
        with pytest.raises(ApiError, match="503 down"):
            api.list_resource_slice(field_selector="x")
    finally:
        kubeapi.time.monotonic = real  # type: ignore[attr-defined]
    assert len(waits) >= 4 and sum(waits) <= 20.0
    for attempt, wait in enumerate(waits):
        assert 0 <= wait <= min(kubeapi.BACKOFF_CAP, kubeapi.BACKOFF_FIRST * 2 ** attempt)
    assert len(set(waits)) == len(waits)  # jittered


def test_a_dropped_connection_is_tried_again_and_a_404_is_not(tmp_path: Path, serve: Any,
                                                              certs: Path) -> None:  # noqa: F811
    def drop_first(n: int, __: Request, conn: ssl.SSLSocket) -> None:
        if n == 0:
            return  # closed without an answer
        answer(conn, 404 if n == 2 else 200, {"message": "not found"} if n == 2 else {"metadata": {"name": "c"}})

    server = serve(drop_first)
    api = client(tmp_path, server, certs, sleep=lambda s: None)
    assert api.read_namespaced_resource_claim("c", "ns") == {"metadata": {"name": "c"}}
    with pytest.raises(ApiError) as caught:
        api.read_namespaced_resource_claim("c", "ns")
    assert caught.value.status == 404 and len(server.requests) == 3


def test_a_refused_connection_is_tried_again_until_the_server_is_back(tmp_path: Path, serve: Any,
                                                                      certs: Path) -> None:  # noqa: F811
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there yet
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", port, certs / "server.crt"))))
    started: list[FakeServer] = []

    def sleep(seconds: float) -> None:
        if not started:  # the server comes up during the first wait
            started.append(FakeServer(certs, lambda n, r, conn: answer(conn, 200, {"ok": 1}), port))

    api.sleep = sleep
    try:
        assert api.read_namespaced_resource_claim("c", "ns") == {"ok": 1}
    finally:
        for server in started:
            server.close()


# --- tokens ---------------------------------------------------------------------------------------------------
def accepting(tokens: list[str]) -> Callable[[int, Request, ssl.SSLSocket], None]:
    def handler(_: int, request: Request, conn: ssl.SSLSocket) -> None:
        if request.headers.get("authorization") == f"Bearer {tokens[0]}":
            answer(conn, 200, {"ok": True})
        else:
            answer(conn, 401, {"kind": "Status", "message": "Unauthorized"})
    return handler


def test_a_token_file_is_read_again_on_401_so_a_replaced_token_is_used_with_no_restart(
        tmp_path: Path, serve: Any, certs: Path) -> None:  # noqa: F811
    token = tmp_path / "token"
    token.write_text("old\n")
    valid = ["old"]
    server = serve(accepting(valid))
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server.port, certs / "server.crt",
                                                 {"tokenFile": "token"}))))
    assert api.read_namespaced_resource_claim("c", "ns") == {"ok": True}
    token.write_text("new\n")
    valid[0] = "new"  # the old one revoked
    assert api.read_namespaced_resource_claim("c", "ns") == {"ok": True}
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer old", "Bearer old", "Bearer new"]
    with pytest.raises(ApiError) as caught:  # a token nobody accepts: the file read again, the same: no loop
        valid[0] = "other"
        api.read_namespaced_resource_claim("c", "ns")
    assert caught.value.status == 401 and len(server.requests) == 4


def test_a_token_file_is_read_again_every_minute() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "token"
        path.write_text("one")
        now = [0.0]
        source = kubeapi.TokenSource(path=str(path), clock=lambda: now[0])
        path.write_text("two")
        now[0] = kubeapi.TOKEN_REFRESH - 1
        assert source.get() == "one"
        now[0] = kubeapi.TOKEN_REFRESH + 1
        assert source.get() == "two"
        path.unlink()  # a file gone for a moment (the kubelet replaces it): the last token is kept
        now[0] = 3 * kubeapi.TOKEN_REFRESH
        assert source.get() == "two"


def test_the_service_accounts_token_is_read_again_in_cluster(tmp_path: Path, serve: Any,
                                                             certs: Path) -> None:  # noqa: F811
    account = tmp_path / "sa"
    account.mkdir()
    (account / "ca.crt").write_bytes((certs / "server.crt").read_bytes())
    (account / "token").write_text("first")
    valid = ["first"]
    server = serve(accepting(valid))
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
    api = ResourceApi(credentials(None, environ=environ, service_account=str(account)))
    assert api.read_namespaced_resource_claim("c", "ns") == {"ok": True}
    (account / "token").write_text("second")
    valid[0] = "second"
    assert api.read_namespaced_resource_claim("c", "ns") == {"ok": True}


# --- kubeconfig ---------------------------------------------------------------------------------------------
def test_kubeconfig_is_honoured_as_a_merged_list(tmp_path: Path, serve: Any, certs: Path) -> None:  # noqa: F811
    server = serve(accepting(["from-b"]))
    full = yaml.safe_load(kubeconfig(tmp_path / "full", server.port, certs / "server.crt",
                                     {"token": "from-b"}).read_text())
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_text(yaml.safe_dump({"current-context": "test", "contexts": full["contexts"],
                                     "clusters": full["clusters"]}))
    second.write_text(yaml.safe_dump({"current-context": "elsewhere", "users": full["users"],
                                      "clusters": [{"name": "c", "cluster": {"server": "https://192.0.2.1"}}]}))
    environ = {"KUBECONFIG": f"{tmp_path / 'missing'}:{first}:{second}", "HOME": str(tmp_path)}
    api = ResourceApi(credentials(None, environ=environ, service_account=str(tmp_path / "none")))
    assert api.read_namespaced_resource_claim("c", "ns") == {"ok": True}


@pytest.mark.parametrize(("field", "value"), [
    ("exec", {"apiVersion": "client.authentication.k8s.io/v1", "command": "aws"}),
    ("auth-provider", {"name": "oidc", "config": {}})])
def test_a_user_with_a_credential_plugin_is_refused_in_one_line_naming_the_file_and_user(
        tmp_path: Path, certs: Path, field: str, value: object) -> None:  # noqa: F811
    path = kubeconfig(tmp_path / "kc", 1, certs / "server.crt", {field: value}, name="ci-bot")
    with pytest.raises(ApiError) as caught:
        credentials(str(path))
    message = caught.value.message
    assert message.startswith(f"{path}: user ci-bot: ") and f"({field}:) is not supported" in message
    assert "\n" not in message


def test_client_certificate_data_leaves_no_file_behind(tmp_path: Path, serve: Any, certs: Path,  # noqa: F811
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("TMPDIR", str(scratch))
    server = serve(lambda n, r, conn: answer(conn, 200, {"ok": True}))
    user = {"client-certificate-data": base64.b64encode((certs / "server.crt").read_bytes()).decode(),
            "client-key-data": base64.b64encode((certs / "server.key").read_bytes()).decode()}
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server.port, certs / "server.crt", user))))
    assert api.read_namespaced_resource_claim("c", "ns") == {"ok": True}
    assert os.listdir(scratch) == []


# --- watch ----------------------------------------------------------------------------------------------------
def test_a_watch_asks_from_a_resource_version_with_bookmarks_and_yields_its_events(
        tmp_path: Path, serve: Any, certs: Path) -> None:  # noqa: F811
    events = [{"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "11"}}},
              {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
              {"type": "DELETED", "object": {"metadata": {"name": "a", "resourceVersion": "13"}}}]

    def stream(_: int, __: Request, conn: ssl.SSLSocket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
        for event in events:
            conn.sendall(json.dumps(event).encode() + b"\n")

    server = serve(stream)
    api = client(tmp_path, server, certs)
    assert list(api.watch_resource_slice("spec.nodeName=n1", "10")) == events
    line = server.requests[0].line
    assert "watch=true" in line and "resourceVersion=10" in line and "allowWatchBookmarks=true" in line
    assert "timeoutSeconds=" in line and "fieldSelector=spec.nodeName%3Dn1" in line
