"""The few API server calls the DRA driver makes (ResourceSlices of its node, and a watch of them; the claims it
prepares), over the standard library's HTTPS client. Measured against lightkube and the official `kubernetes`
package in docs/dra.md ("The API client"): neither bounds a call's time or its answer, nor retries.

Credentials as client-go finds them: `--kubeconfig`, else `$KUBECONFIG` (a colon-separated list, merged: the
first file to name a context, cluster or user wins), else the pod's service account (in-cluster), else
~/.kube/config. A user authenticates with a client certificate (files, or data loaded through a memfd: no
key file is ever written), a token, or a token file; a token file (the service account's, a kubeconfig's
`tokenFile`) is read again every minute and at once on a 401, as client-go does, so a rotated or re-issued
token is used with no restart. A user with `exec:` or `auth-provider:` is refused with one line naming the
file and the user (devinject runs no credential plugin).

A connection whose answer came whole is kept (KEEP_IDLE of them, for IDLE_REUSE seconds) and the next GET goes
over it: a claim's read on the prepare path is then one round trip, not a TCP and TLS handshake first (~1.5
against ~6 ms to this machine's API server). Only a GET is sent on a kept connection (one the server closed
meanwhile is dropped and the GET sent on a new one, which asks nothing twice that could change anything);
every other method opens its own.

Every attempt has one wall-clock deadline (REQUEST_TIMEOUT, from connect to the answer's last byte: a watchdog
shuts the socket down when it passes, since a socket timeout bounds each read only) and an answer is refused
past MAX_ANSWER bytes while it is read. A call is tried again on connection errors, timeouts, 429 and 5xx,
with exponential backoff and full jitter, waiting at least what `Retry-After` asks, within RETRY_BUDGET.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from devinject.core.asciitext import is_digits
from devinject.core.deadline import SocketDeadline
from devinject.core.errors import DevinjectError

REQUEST_TIMEOUT = 10.0  # wall-clock seconds per attempt, connect to last byte
RETRY_BUDGET = 30.0  # seconds all attempts of one call may take, waits included
MAX_ANSWER = 32 << 20  # bytes: a node's slices are a few MiB at most (an object is at most 1.5 MiB in etcd)
TOKEN_REFRESH = 60.0  # seconds a token read from a file is used before the file is read again (client-go's)
BACKOFF_FIRST, BACKOFF_CAP = 0.25, 8.0
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
WATCH_SECONDS = 300  # the server ends a watch after this; the client's deadline is a little later
KEEP_IDLE = 2  # connections kept for the next GET (prepares run side by side on the kubelet's calls)
IDLE_REUSE = 30.0  # seconds a kept connection is used again; older, it is closed (servers end idle ones)
WATCH_IDLE = 120.0  # seconds without a byte (bookmarks come every minute) before a watch is given up
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
CLAIM_STATUS = CLAIMS + "/status"
PODS = "/api/v1/namespaces/{namespace}/pods"
TAINT_RULES = "/apis/resource.k8s.io/{version}/devicetaintrules"
MAX_PODS = 500  # a node runs 110 pods by default: one page is all of a namespace's on one node


class ApiError(DevinjectError):
    """An API call that failed: `status` is the HTTP status (0 when no answer came), `reason` what went wrong
    without the call's name (the status and the server's message, or the connection's error), `retry` whether
    trying again may help, `retry_after` the seconds the server asked to wait (None when it did not)."""

    def __init__(self, message: str, status: int = 0, reason: str = "", retry: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason or message
        self.retry, self.retry_after = retry, retry_after


class TokenSource:
    """A bearer token: fixed (a kubeconfig's `token`), or read from `path` and read again when older than
    `refresh` seconds or after a 401 (`reread`)."""

    def __init__(self, token: str | None = None, path: str | None = None, refresh: float = TOKEN_REFRESH,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.refresh, self.clock = path, refresh, clock
        self.lock = threading.Lock()
        self.token, self.read_at = token, -float("inf")
        if path is not None:
            self.reread()

    def _read(self) -> str:
        assert self.path is not None
        try:
            with open(self.path, encoding="utf-8") as handle:
                return handle.read().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ApiError(f"{self.path}: cannot read the token: {getattr(err, 'strerror', None) or err}") from None

    def get(self) -> str | None:
        with self.lock:
            if self.path is not None and self.clock() - self.read_at >= self.refresh:
                try:
                    self.token, self.read_at = self._read(), self.clock()
                except ApiError:
                    if self.token is None:
                        raise  # a token file that went away meanwhile: the one read last is kept
            return self.token

    def reread(self) -> bool:
        """Read the file again now (after a 401): True when it holds another token than the one sent."""
        if self.path is None:
            return False
        with self.lock:
            old, self.token, self.read_at = self.token, self._read(), self.clock()
            return self.token != old


class Credentials:
    """Where the API server is and how to prove who we are to it."""

    def __init__(self, server: str, context: ssl.SSLContext, token: str | TokenSource | None = None) -> None:
        parsed = urllib.parse.urlsplit(server)
        if parsed.scheme != "https" or not parsed.hostname:
            raise ApiError(f"{server}: the API server must be an https:// URL")
        self.host, self.port = parsed.hostname, parsed.port or 443
        self.prefix = parsed.path.rstrip("/")
        self.context = context
        self.tokens = token if isinstance(token, TokenSource) else TokenSource(token)


def _tls(ca_file: str | None, ca_data: str | None, cert: tuple[str, str] | None = None,
         cert_data: tuple[bytes, bytes] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file, cadata=ca_data)
    if cert is not None:
        context.load_cert_chain(*cert)
    if cert_data is not None:
        # ssl reads a certificate and key from a file only: an anonymous memory file, gone when closed
        fd = os.memfd_create("devinject-client-cert", os.MFD_CLOEXEC)
        try:
            os.write(fd, cert_data[0].rstrip(b"\n") + b"\n" + cert_data[1])
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    return context


@dataclass
class _Named:
    """A context, cluster or user of a kubeconfig, with the file that defined it (relative paths are its)."""

    value: dict[str, Any]
    path: str

    def file(self, key: str) -> str | None:
        name = self.value.get(key)
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), name) if name else None


@dataclass
class _Merged:
    current: str | None = None
    current_from: str = ""
    named: dict[str, dict[str, _Named]] = field(default_factory=lambda: {"contexts": {}, "clusters": {},
                                                                         "users": {}})


def _load(paths: list[str]) -> _Merged:
    import yaml

    merged = _Merged()
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                config = yaml.safe_load(handle)
            if not isinstance(config, dict):
                raise TypeError("not a mapping")
            for kind in ("contexts", "clusters", "users"):
                for item in config.get(kind) or []:
                    merged.named[kind].setdefault(item["name"], _Named(item[kind[:-1]] or {}, path))
        except OSError as err:
            raise ApiError(f"{path}: cannot read the kubeconfig: {err.strerror}") from None
        except (yaml.YAMLError, KeyError, TypeError, AttributeError) as err:
            raise ApiError(f"{path}: not a kubeconfig devinject can use ({type(err).__name__}: {err})") from None
        if merged.current is None and config.get("current-context"):
            merged.current, merged.current_from = config["current-context"], path
    return merged


def _from_kubeconfig(paths: list[str]) -> Credentials:
    merged = _load(paths)
    where = merged.current_from or paths[0]
    try:
        context = merged.named["contexts"][str(merged.current)]
        cluster = merged.named["clusters"][context.value["cluster"]]
        user_name = context.value.get("user")
        user = merged.named["users"].get(user_name) if user_name else None
        server = cluster.value["server"]
    except (KeyError, TypeError, AttributeError) as err:
        raise ApiError(f"{where}: not a kubeconfig devinject can use ({type(err).__name__}: {err})") from None
    fields = user.value if user is not None else {}
    for key, what in (("exec", "an exec credential plugin"), ("auth-provider", "an auth provider")):
        if fields.get(key):
            assert user is not None
            raise ApiError(f"{user.path}: user {user_name}: {what} ({key}:) is not supported; give it a token, "
                           "tokenFile or client certificate")
    try:
        ca_data = base64.b64decode(cluster.value["certificate-authority-data"]).decode() \
            if cluster.value.get("certificate-authority-data") else None
        cert = cert_data = None
        if user is not None and fields.get("client-certificate") and fields.get("client-key"):
            cert = (str(user.file("client-certificate")), str(user.file("client-key")))
        elif fields.get("client-certificate-data") and fields.get("client-key-data"):
            cert_data = (base64.b64decode(fields["client-certificate-data"]),
                         base64.b64decode(fields["client-key-data"]))
        token: str | TokenSource | None = fields.get("token") or None
        if not token and user is not None and fields.get("tokenFile"):
            token = TokenSource(path=user.file("tokenFile"))
        return Credentials(server, _tls(cluster.file("certificate-authority"), ca_data, cert, cert_data), token)
    except (ssl.SSLError, OSError, ValueError) as err:
        raise ApiError(f"{where}: its certificates: {err}") from None


def _in_cluster(service_account: str, environ: dict[str, str] | os._Environ[str]) -> Credentials | None:
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not os.path.exists(f"{service_account}/token"):
        return None
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return Credentials(server, _tls(f"{service_account}/ca.crt", None),
                       TokenSource(path=f"{service_account}/token"))


def credentials(kubeconfig: str | None, environ: dict[str, str] | os._Environ[str] | None = None,
                service_account: str = SERVICE_ACCOUNT) -> Credentials:
    """--kubeconfig, else $KUBECONFIG, else in-cluster, else ~/.kube/config."""
    environ = os.environ if environ is None else environ
    if kubeconfig:
        return _from_kubeconfig([kubeconfig])
    listed = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        present = [p for p in listed if os.path.exists(p)]
        if not present:
            raise ApiError(f"KUBECONFIG={environ['KUBECONFIG']}: no such file")
        return _from_kubeconfig(present)
    found = _in_cluster(service_account, environ)
    if found is not None:
        return found
    default = os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".kube", "config")
    if not os.path.exists(default):
        raise ApiError("no --kubeconfig, no KUBECONFIG, no service account (in-cluster) and no ~/.kube/config")
    return _from_kubeconfig([default])


class _Connection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, tls: ssl.SSLContext, deadline: SocketDeadline,
                 idle: float | None = None) -> None:
        super().__init__(host, port, timeout=deadline.left(), context=tls)
        self.tls, self.deadline, self.idle = tls, deadline, idle

    def connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), self.deadline.left())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.deadline.arm(self.sock)
        self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.host)
        if self.idle is not None:
            self.sock.settimeout(self.idle)

    def rearm(self, deadline: SocketDeadline) -> None:
        """A kept connection, for another attempt's deadline."""
        self.deadline = deadline
        self.sock.settimeout(deadline.left())
        deadline.arm(self.sock)


class _Kept:
    """Connections whose last answer came whole, for the next GET: at most KEEP_IDLE, each IDLE_REUSE s."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[tuple[float, _Connection]] = []

    def take(self) -> _Connection | None:
        now = time.monotonic()
        with self.lock:
            while self.idle:
                since, connection = self.idle.pop()
                if now - since < IDLE_REUSE:
                    return connection
                connection.close()
        return None

    def put(self, connection: _Connection) -> None:
        with self.lock:
            self.idle.append((time.monotonic(), connection))
            old = self.idle[:-KEEP_IDLE]
            del self.idle[:-KEEP_IDLE]
        for _, stale in old:
            stale.close()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            from email.utils import parsedate_to_datetime

            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


class ResourceApi:
    """resource.k8s.io/v1 calls by the names the official client gives them, answering parsed JSON."""

    def __init__(self, creds: Credentials, timeout: float = REQUEST_TIMEOUT, budget: float = RETRY_BUDGET,
                 max_answer: int = MAX_ANSWER, sleep: Callable[[float], None] = time.sleep) -> None:
        self.creds, self.timeout, self.budget, self.max_answer = creds, timeout, budget, max_answer
        self.sleep = sleep
        self.kept = _Kept()

    def _headers(self, body: bytes | None, method: str = "GET") -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "devinject-dra-driver"}
        token = self.creds.tokens.get()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:  # a PATCH is a server-side apply (JSON is YAML)
            headers["Content-Type"] = "application/apply-patch+yaml" if method == "PATCH" else "application/json"
        return headers

    def _open(self, method: str, url: str, data: bytes | None, deadline: SocketDeadline,
              idle: float | None = None) -> tuple[_Connection, http.client.HTTPResponse]:
        connection = _Connection(self.creds.host, self.creds.port, self.creds.context, deadline, idle)
        try:
            connection.request(method, url, body=data, headers=self._headers(data, method))
            return connection, connection.getresponse()
        except BaseException:
            connection.close()
            raise

    def _reused(self, method: str, url: str, deadline: SocketDeadline) \
            -> tuple[_Connection, http.client.HTTPResponse] | None:
        """A GET's answer over a kept connection; None when none is kept or the one taken was closed by the
        server meanwhile (before the deadline: nothing answered, the caller opens a new connection)."""
        if method != "GET":
            return None
        connection = self.kept.take()
        if connection is None:
            return None
        try:
            connection.rearm(deadline)
            connection.request(method, url, headers=self._headers(None))
            return connection, connection.getresponse()
        except (OSError, http.client.HTTPException):
            connection.close()
            deadline.disarm()
            if deadline.expired:
                raise
            return None

    def _read(self, response: http.client.HTTPResponse, what: str) -> bytes:
        length = response.getheader("Content-Length")
        if length and is_digits(length) and int(length) > self.max_answer:
            raise ApiError(f"{what}: an answer of {int(length)} bytes, more than {self.max_answer}: refused",
                           reason=f"answer larger than {self.max_answer} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = response.read(65536)
            if not chunk:
                if length and is_digits(length) and size < int(length):  # http.client says nothing of it
                    raise http.client.IncompleteRead(b"", int(length) - size)
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_answer:
                raise ApiError(f"{what}: an answer of more than {self.max_answer} bytes: refused",
                               reason=f"answer larger than {self.max_answer} bytes")
            chunks.append(chunk)

    def _attempt(self, method: str, path: str, url: str, data: bytes | None, timeout: float) -> dict[str, Any]:
        what = f"{method} {path}"
        deadline = SocketDeadline(timeout)
        connection = None
        keep = False
        try:
            exchange = self._reused(method, url, deadline) or self._open(method, url, data, deadline)
            connection, response = exchange
            payload = self._read(response, what)
            if deadline.expired:  # shut down at the deadline: what came before it is not the answer
                raise TimeoutError("deadline passed")
            keep = not response.will_close and response.isclosed()  # read whole, and the server keeps it open
        except ssl.SSLCertVerificationError as err:  # a server we must not talk to: asking again changes nothing
            raise ApiError(f"{what}: {err}", reason=str(err)) from None
        except (OSError, http.client.HTTPException) as err:
            if deadline.expired:
                raise ApiError(f"{what}: no answer within {deadline.seconds:g} s",
                               reason=f"no answer within {deadline.seconds:g} s", retry=True) from None
            raise ApiError(f"{what}: {err or type(err).__name__}", reason=str(err) or type(err).__name__,
                           retry=True) from None
        finally:
            deadline.close()
            if connection is not None:
                if keep and not deadline.expired:
                    self.kept.put(connection)
                else:
                    connection.close()
        try:
            answer = json.loads(payload or b"{}")
        except ValueError:
            answer = {}
        if response.status >= 300:
            message = answer.get("message") if isinstance(answer, dict) else None
            reason = f"{response.status} {message or response.reason}"
            raise ApiError(f"{what}: {reason}", response.status, reason, retry=response.status in RETRY_STATUSES,
                           retry_after=_retry_after(response.getheader("Retry-After")))
        return answer if isinstance(answer, dict) else {}

    def request(self, method: str, path: str, body: object = None, query: dict[str, str] | None = None,
                budget: float | None = None) -> dict[str, Any]:
        """One call, tried again while the failure may pass and the wait ends within `budget` seconds
        (RETRY_BUDGET) of the start; a 401 reads a token file again and tries once more when it held a new
        token."""
        url = self.creds.prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        end = time.monotonic() + (self.budget if budget is None else budget)
        attempt, reread = 0, False
        while True:
            # the first attempt has its whole deadline; one tried again only what is left of the budget
            timeout = self.timeout if attempt == 0 else min(self.timeout, max(1.0, end - time.monotonic()))
            try:
                return self._attempt(method, path, url, data, timeout)
            except ApiError as err:
                if err.status == 401 and not reread:
                    reread = True
                    if self.creds.tokens.reread():
                        continue  # a new token in the file: tried at once, once
                if not err.retry:
                    raise
                backoff = random.uniform(0, min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** attempt))
                wait = max(backoff, err.retry_after) if err.retry_after is not None else backoff
                if time.monotonic() + wait >= end:
                    raise
                attempt += 1
                self.sleep(wait)

    def watch(self, path: str, query: dict[str, str], seconds: int = WATCH_SECONDS) -> Iterator[dict[str, Any]]:
        """The events of one watch (`watch=true`, bookmarks asked for), until the server ends it or its
        deadline (`seconds` and a margin) passes; an event line is bounded as an answer is. ApiError when it
        cannot start (the caller backs off and lists again on 410)."""
        query = {**query, "watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(seconds)}
        url = self.creds.prefix + path + "?" + urllib.parse.urlencode(query)
        what = f"WATCH {path}"
        deadline = SocketDeadline(seconds + 30)
        connection = None
        try:
            try:
                connection, response = self._open("GET", url, None, deadline, WATCH_IDLE)
                if response.status == 401 and self.creds.tokens.reread():
                    connection.close()
                    connection, response = self._open("GET", url, None, deadline, WATCH_IDLE)
                if response.status >= 300:
                    payload = self._read(response, what)
                    try:
                        message = json.loads(payload).get("message")
                    except (ValueError, AttributeError):
                        message = None
                    reason = f"{response.status} {message or response.reason}"
                    raise ApiError(f"{what}: {reason}", response.status, reason,
                                   retry_after=_retry_after(response.getheader("Retry-After")))
                while True:
                    line = response.readline(self.max_answer + 1)
                    if not line:
                        return
                    if len(line) > self.max_answer:
                        raise ApiError(f"{what}: an event of more than {self.max_answer} bytes: refused")
                    try:
                        event = json.loads(line)
                    except ValueError:
                        raise ApiError(f"{what}: an event that is not JSON") from None
                    if isinstance(event, dict):
                        yield event
            except (OSError, http.client.HTTPException) as err:
                if deadline.expired:
                    return  # the watch's time is up: the caller starts the next one
                raise ApiError(f"{what}: {err or type(err).__name__}", reason=str(err) or type(err).__name__,
                               retry=True) from None
        finally:
            deadline.close()
            if connection is not None:
                connection.close()

    def list_resource_slice(self, field_selector: str) -> dict[str, Any]:
        return self.request("GET", SLICES, query={"fieldSelector": field_selector})

    def watch_resource_slice(self, field_selector: str, resource_version: str) -> Iterator[dict[str, Any]]:
        return self.watch(SLICES, {"fieldSelector": field_selector, "resourceVersion": resource_version})

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", SLICES, body)

    def replace_resource_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PUT", f"{SLICES}/{urllib.parse.quote(name)}", body)

    def delete_resource_slice(self, name: str) -> dict[str, Any]:
        return self.request("DELETE", f"{SLICES}/{urllib.parse.quote(name)}")

    def apply_resource_claim_status(self, name: str, namespace: str, body: dict[str, Any], manager: str,
                                    budget: float | None = None) -> dict[str, Any]:
        """Server-side apply of a claim's status as `manager` (its entries of status.devices are its own)."""
        return self.request("PATCH", CLAIM_STATUS.format(namespace=urllib.parse.quote(namespace),
                                                         name=urllib.parse.quote(name)), body,
                            query={"fieldManager": manager, "force": "true"}, budget=budget)

    def list_device_taint_rules(self, version: str) -> dict[str, Any]:
        return self.request("GET", TAINT_RULES.format(version=urllib.parse.quote(version)))

    def list_namespaced_pod(self, namespace: str, field_selector: str, budget: float | None = None) \
            -> dict[str, Any]:
        return self.request("GET", PODS.format(namespace=urllib.parse.quote(namespace)),
                            query={"fieldSelector": field_selector, "limit": str(MAX_PODS)}, budget=budget)

    def read_namespaced_resource_claim(self, name: str, namespace: str, budget: float | None = None) \
            -> dict[str, Any]:
        return self.request("GET", CLAIMS.format(namespace=urllib.parse.quote(namespace),
                                                 name=urllib.parse.quote(name)), budget=budget)
