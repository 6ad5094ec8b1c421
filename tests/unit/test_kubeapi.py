"""The DRA driver's API client against a real HTTPS server on loopback (its own CA, a kubeconfig as
cluster-up.sh writes one): the calls, the credentials, errors and deadlines. The real API server is the peer
of tests/e2e/test_dra_live.py."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from devinject.dra.kubeapi import ApiError, ResourceApi, credentials


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test server's certificate")
    directory = tmp_path_factory.mktemp("pki")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout",
                    str(directory / "server.key"), "-out", str(directory / "server.crt")],
                   check=True, capture_output=True)
    return directory


class Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []
    answers: dict[tuple[str, str], tuple[int, object]] = {}

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append({"method": self.command, "path": self.path, "body": body,
                          "auth": self.headers.get("Authorization"), "peer": self.client_address,
                          "type": self.headers.get("Content-Type"),
                          "client_cert": bool(self.connection.getpeercert())})  # type: ignore[attr-defined]
        status, answer = self.answers.get((self.command, self.path.split("?")[0]), (200, {"ok": True}))
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

    def log_message(self, *args: object) -> None:
        pass


class KeepAlive(Recorder):
    """HTTP/1.1: the connection stays open after an answer (as the API server's does), unless `drop` says the
    server closes it after the next one without saying so (an idle connection the server ended)."""

    protocol_version = "HTTP/1.1"
    drop = False

    def _answer(self) -> None:
        super()._answer()
        if KeepAlive.drop:
            KeepAlive.drop = False
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer


@pytest.fixture(params=[Recorder])
def server(certs: Path, request: pytest.FixtureRequest) -> Iterator[int]:
    Recorder.seen, Recorder.answers, KeepAlive.drop = [], {}, False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), request.param)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / "server.crt", certs / "server.key")
    context.verify_mode = ssl.CERT_OPTIONAL  # asks for a client certificate, checks one that is sent
    context.load_verify_locations(certs / "server.crt")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def kubeconfig(path: Path, port: int, ca: Path, **user: str) -> Path:
    cluster = {"server": f"https://127.0.0.1:{port}",
               "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}]}))
    return path


def test_the_calls_the_driver_makes_reach_the_server_as_the_official_client_sends_them(
        tmp_path: Path, server: int, certs: Path) -> None:
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server, certs / "server.crt", token="s3cret"))))
    Recorder.answers[("GET", "/apis/resource.k8s.io/v1/resourceslices")] = (200, {"items": [{"metadata": {}}]})
    assert api.list_resource_slice(field_selector="spec.nodeName=n1,spec.driver=d") == {"items": [{"metadata": {}}]}
    api.create_resource_slice({"metadata": {"name": "a"}})
    api.replace_resource_slice("a", {"metadata": {"name": "a"}})
    api.delete_resource_slice("a")
    api.read_namespaced_resource_claim("claim-1", "ns")
    assert [(s["method"], s["path"]) for s in Recorder.seen] == [
        ("GET", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn1%2Cspec.driver%3Dd"),
        ("POST", "/apis/resource.k8s.io/v1/resourceslices"),
        ("PUT", "/apis/resource.k8s.io/v1/resourceslices/a"),
        ("DELETE", "/apis/resource.k8s.io/v1/resourceslices/a"),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/claim-1")]
    assert {s["auth"] for s in Recorder.seen} == {"Bearer s3cret"}
    assert not any(s["client_cert"] for s in Recorder.seen)
    assert Recorder.seen[1]["body"] == {"metadata": {"name": "a"}}


@pytest.mark.parametrize("server", [KeepAlive], indirect=True)
def test_gets_go_over_one_kept_connection_and_nothing_else_does(tmp_path: Path, server: int, certs: Path) -> None:
    """A claim's read on the prepare path: a round trip over the connection the last whole answer came on,
    not a TCP and TLS handshake each time; a POST, PUT or DELETE opens its own connection."""
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server, certs / "server.crt", token="t"))))
    for _ in range(3):
        api.read_namespaced_resource_claim("claim-1", "ns")
    api.create_resource_slice({"metadata": {"name": "a"}})
    api.replace_resource_slice("a", {"metadata": {"name": "a"}})
    api.read_namespaced_resource_claim("claim-1", "ns")
    peers = [s["peer"] for s in Recorder.seen]
    assert len(set(peers[:3])) == 1, peers  # one connection for the three GETs
    assert len({*peers[:3], peers[3], peers[4]}) == 3, peers  # the POST and the PUT each on a new one
    assert peers[5] in {peers[3], peers[4]}, peers  # the next GET on a connection kept since


@pytest.mark.parametrize("server", [KeepAlive], indirect=True)
def test_a_kept_connection_the_server_closed_is_replaced_with_no_retry(tmp_path: Path, server: int,
                                                                      certs: Path) -> None:
    waits: list[float] = []
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server, certs / "server.crt", token="t"))),
                      sleep=waits.append)
    Recorder.answers[("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c")] = (200, {"n": 1})
    KeepAlive.drop = True  # closed after this answer, the client not told
    assert api.read_namespaced_resource_claim("c", "ns") == {"n": 1}
    assert api.read_namespaced_resource_claim("c", "ns") == {"n": 1}
    peers = [s["peer"] for s in Recorder.seen]
    assert len(peers) == 2 and peers[0] != peers[1] and waits == [], (peers, waits)


def test_an_error_answer_is_one_line_with_the_servers_message(tmp_path: Path, server: int, certs: Path) -> None:
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server, certs / "server.crt", token="t"))))
    Recorder.answers[("POST", "/apis/resource.k8s.io/v1/resourceslices")] = (
        409, {"kind": "Status", "message": 'resourceslices "a" already exists'})
    with pytest.raises(ApiError) as caught:
        api.create_resource_slice({"metadata": {"name": "a"}})
    assert caught.value.status == 409
    assert caught.value.message == ('POST /apis/resource.k8s.io/v1/resourceslices: 409 resourceslices "a" '
                                    "already exists")


def test_a_server_whose_certificate_the_kubeconfig_does_not_vouch_for_is_refused(
        tmp_path: Path, server: int, certs: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=x",
                    "-keyout", str(other / "k"), "-out", str(other / "c")], check=True, capture_output=True)
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server, other / "c", token="t"))))
    with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):
        api.delete_resource_slice("a")
    assert Recorder.seen == []


def test_a_server_that_never_answers_is_an_error_not_a_hang(tmp_path: Path, certs: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection, never speaks TLS
    try:
        creds = credentials(str(kubeconfig(tmp_path / "kc", silent.getsockname()[1], certs / "server.crt",
                                           token="t")))
        api = ResourceApi(creds, timeout=0.5)
        api.budget = 0  # one attempt: retries are tested in test_kubeapi_failures.py
        with pytest.raises(ApiError, match="timed out|no answer within 0.5 s"):
            api.list_resource_slice(field_selector="x")
    finally:
        silent.close()


@pytest.mark.parametrize("text", ["{not yaml", "current-context: nowhere\ncontexts: []\n", "[]"])
def test_a_kubeconfig_devinject_cannot_use_is_one_line_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "kc"
    path.write_text(text)
    with pytest.raises(ApiError, match=f"^{path}: not a kubeconfig devinject can use"):
        credentials(str(path))


def test_a_client_certificate_in_the_kubeconfig_is_used(tmp_path: Path, server: int, certs: Path) -> None:
    """cluster-up.sh's admin kubeconfig names a client certificate; its data fields go to a private dir."""
    data = {"client-certificate-data": base64.b64encode((certs / "server.crt").read_bytes()).decode(),
            "client-key-data": base64.b64encode((certs / "server.key").read_bytes()).decode()}
    api = ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", server, certs / "server.crt", **data))))
    api.delete_resource_slice("a")
    assert Recorder.seen[0]["auth"] is None and Recorder.seen[0]["client_cert"]  # the certificate is the credential
