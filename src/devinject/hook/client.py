"""The hook's side of `devinject hook-server`: hand the invocation (arguments, and the runtime's own
stdin, stdout and stderr, passed as file descriptors) to a resident server, whose worker has every module
loaded already, and exit with its status: the hand-over costs ~1.2 ms, and the hook's run ~5 ms in a
worker against ~9.5 ms in-process, imports included (bench/bench_hook.py).

No server (no socket, nobody listening, or not running as this user) means the hook runs in-process, as
it always could. Once the request is handed over it is the server's: the hook never runs it a second time.
Only `_socket` is imported (not `socket`, which imports `enum` and `selectors`)."""

from __future__ import annotations

import os
import sys

DEFAULT_SOCKET = "/run/devinject/hook.sock"
CONNECT_TIMEOUT = 1.0
REPLY_TIMEOUT = 60.0  # the worker's own deadlines end first (30 s for the namespace work)
MAX_REQUEST = 1 << 20


def server_socket(args: list[str]) -> str | None:
    """`--server PATH` (the last one wins; `--server=` or `--no-server` turns it off), else the default."""
    path: str | None = DEFAULT_SOCKET
    for i, arg in enumerate(args):
        if arg == "--no-server":
            path = None
        elif arg == "--server":
            path = args[i + 1] if i + 1 < len(args) else None
        elif arg.startswith("--server="):
            path = arg[len("--server="):]
    return path or None


def encode_request(args: list[str]) -> bytes:
    """Length (4 bytes, big endian) and the arguments, NUL-separated."""
    payload = "\0".join(args).encode()
    return len(payload).to_bytes(4, "big") + payload


def decode_request(data: bytes) -> list[str] | None:
    if len(data) < 4 or int.from_bytes(data[:4], "big") != len(data) - 4:
        return None
    try:
        return data[4:].decode().split("\0")
    except UnicodeDecodeError:
        return None


def run_via_server(args: list[str]) -> int | None:
    """The hook's exit status as the server's worker gives it; None when no server takes the request."""
    path = server_socket(args[1:])
    if path is None or not os.path.exists(path):
        return None
    import _socket

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.connect(path)
            # the server must run as this very user: a socket somebody else could have put there is not used
            peer = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
            if int.from_bytes(peer[4:8], sys.byteorder) != os.geteuid():
                return None
            request = encode_request(args)
            if len(request) > MAX_REQUEST:
                return None
            fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2))
            sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        except OSError:
            return None  # nobody took it: run in-process
        sock.settimeout(REPLY_TIMEOUT)
        try:
            reply = sock.recv(1)
        except OSError as err:
            reply, why = b"", f"no answer from the hook server {path}: {err}"
        else:
            why = f"the hook server {path} ended the request without an answer"
        if not reply:
            print(f"devinject: error: {why}", file=sys.stderr)
            return 1
        return reply[0]
    finally:
        sock.close()
