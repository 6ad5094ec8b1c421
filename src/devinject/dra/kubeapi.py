"""The few API server calls the DRA driver makes (ResourceSlices of its node, the claims it prepares), over the
standard library's HTTPS client. The official `kubernetes` package would cost the agent's image 126 MiB for
five REST calls (docs/dra.md, "Why not the kubernetes package").

Credentials as the official client finds them: `--kubeconfig` (its current context: the server, its CA, a
client certificate or a bearer token), else the pod's service account (in-cluster), else ~/.kube/config.
Every call has a deadline (REQUEST_TIMEOUT): a driver never blocks on a dead API server.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import tempfile
import urllib.parse
from typing import Any

from devinject.core.errors import DevinjectError

REQUEST_TIMEOUT = 10.0
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


class ApiError(DevinjectError):
    """An API call that failed: `status` is the HTTP status (0 when no answer came), `reason` what went wrong
    without the call's name (the status and the server's message, or the connection's error)."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status, self.reason = status, reason or message


class Credentials:
    """Where the API server is and how to prove who we are to it."""

    def __init__(self, server: str, context: ssl.SSLContext, token: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(server)
        if parsed.scheme != "https" or not parsed.hostname:
            raise ApiError(f"{server}: the API server must be an https:// URL")
        self.host, self.port = parsed.hostname, parsed.port or 443
        self.prefix = parsed.path.rstrip("/")
        self.context, self.token = context, token


def _tls(ca_file: str | None, ca_data: str | None, cert: tuple[str, str] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file, cadata=ca_data)
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


def _from_kubeconfig(path: str) -> Credentials:
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
        named = {kind: {item["name"]: item[kind[:-1]] for item in config.get(kind) or []}
                 for kind in ("contexts", "clusters", "users")}
        context = named["contexts"][config["current-context"]]
        cluster, user = named["clusters"][context["cluster"]], named["users"].get(context.get("user"), {}) or {}
    except OSError as err:
        raise ApiError(f"{path}: cannot read the kubeconfig: {err.strerror}") from None
    except (yaml.YAMLError, KeyError, TypeError, AttributeError) as err:
        raise ApiError(f"{path}: not a kubeconfig devinject can use ({type(err).__name__}: {err})") from None
    base = os.path.dirname(os.path.abspath(path))

    def relative(name: str | None) -> str | None:
        return os.path.join(base, name) if name else None

    ca_data = base64.b64decode(cluster["certificate-authority-data"]).decode() \
        if cluster.get("certificate-authority-data") else None
    cert = None
    if user.get("client-certificate-data") or user.get("client-certificate"):
        cert = _client_cert(user, relative)
    token = user.get("token")
    if not token and user.get("tokenFile"):
        with open(str(relative(user["tokenFile"])), encoding="utf-8") as handle:
            token = handle.read().strip()
    try:
        return Credentials(cluster["server"], _tls(relative(cluster.get("certificate-authority")), ca_data, cert),
                           token)
    except (ssl.SSLError, OSError) as err:
        raise ApiError(f"{path}: its certificates: {err}") from None


def _client_cert(user: dict[str, Any], relative: Any) -> tuple[str, str]:
    """The client certificate and key as files (ssl reads only files): data fields go to a private temp dir."""
    if user.get("client-certificate") and user.get("client-key"):
        return relative(user["client-certificate"]), relative(user["client-key"])
    directory = tempfile.mkdtemp(prefix="devinject-kubeapi-")  # 0700
    paths = []
    for field in ("client-certificate-data", "client-key-data"):
        target = os.path.join(directory, field)
        fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(base64.b64decode(user[field]))
        paths.append(target)
    return paths[0], paths[1]


def _in_cluster() -> Credentials | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not os.path.exists(f"{SERVICE_ACCOUNT}/token"):
        return None
    with open(f"{SERVICE_ACCOUNT}/token", encoding="utf-8") as handle:
        token = handle.read().strip()
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return Credentials(server, _tls(f"{SERVICE_ACCOUNT}/ca.crt", None, None), token)


def credentials(kubeconfig: str | None) -> Credentials:
    """--kubeconfig, else in-cluster, else ~/.kube/config (as the official client looks)."""
    if kubeconfig:
        return _from_kubeconfig(kubeconfig)
    found = _in_cluster()
    if found is not None:
        return found
    default = os.path.expanduser("~/.kube/config")
    if not os.path.exists(default):
        raise ApiError("no --kubeconfig, no service account (in-cluster) and no ~/.kube/config")
    return _from_kubeconfig(default)


class ResourceApi:
    """resource.k8s.io/v1 calls by the names the official client gives them, answering parsed JSON."""

    def __init__(self, creds: Credentials, timeout: float = REQUEST_TIMEOUT) -> None:
        self.creds, self.timeout = creds, timeout

    def request(self, method: str, path: str, body: object = None, query: dict[str, str] | None = None) \
            -> dict[str, Any]:
        url = self.creds.prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        if self.creds.token:
            headers["Authorization"] = f"Bearer {self.creds.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        connection = http.client.HTTPSConnection(self.creds.host, self.creds.port, timeout=self.timeout,
                                                 context=self.creds.context)
        try:
            connection.request(method, url, body=data, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as err:
            raise ApiError(f"{method} {path}: {err}", reason=str(err)) from None
        finally:
            connection.close()
        try:
            answer = json.loads(payload or b"{}")
        except ValueError:
            answer = {}
        if response.status >= 300:
            message = answer.get("message") if isinstance(answer, dict) else None
            reason = f"{response.status} {message or response.reason}"
            raise ApiError(f"{method} {path}: {reason}", response.status, reason)
        return answer if isinstance(answer, dict) else {}

    def list_resource_slice(self, field_selector: str) -> dict[str, Any]:
        return self.request("GET", SLICES, query={"fieldSelector": field_selector})

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", SLICES, body)

    def replace_resource_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PUT", f"{SLICES}/{urllib.parse.quote(name)}", body)

    def delete_resource_slice(self, name: str) -> dict[str, Any]:
        return self.request("DELETE", f"{SLICES}/{urllib.parse.quote(name)}")

    def read_namespaced_resource_claim(self, name: str, namespace: str) -> dict[str, Any]:
        return self.request("GET", CLAIMS.format(namespace=urllib.parse.quote(namespace),
                                                 name=urllib.parse.quote(name)))
