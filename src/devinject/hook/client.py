"""The hook's side of `devinject hook-server` (the socket client): hand the invocation (arguments, and the runtime's own
stdin, stdout and stderr, passed as file descriptors) to a resident server, whose worker has every module
loaded already, and exit with its status (bench/bench_hook.py measures both ways).

A spec's `cdi-hook` (a createContainer hook, run in the container's mount namespace) is handed over the same
way when it has links or library folders to make (entry.py `worth_serving`): the server's worker joins that very
process's mount namespace and root and runs what it would have run.

No server (no socket, nobody listening, or not running as this user) means the hook runs in-process, as
it always could, and so does a server's REFUSED answer: this hook runs in other namespaces than the server
(a runtime in a nested pid namespace; a cdi-hook in another user namespace), and nothing was done for it.
Once the request is otherwise handed over it is the server's: the hook never runs it a second time.

The served path runs on every container start in an interpreter started with -S, so it imports only what
is built in: `posix` and `_socket` (not `os`, ~1.4 ms of imports there, nor `socket`, which adds `enum` and
`selectors`); no `from __future__` import either (it is a module too). The one devinject module it reads is
core/paths.py, for the socket's default: constants, which import nothing.
"""

import posix
import sys

from devinject.core.paths import HOOK_SOCKET

TYPE_CHECKING = False  # `typing` is a module too: type checkers only
if TYPE_CHECKING:
    import _socket

DEFAULT_SOCKET = HOOK_SOCKET  # where the server listens and the hook looks, unless told otherwise
CONNECT_TIMEOUT = 1.0
REPLY_TIMEOUT = 60.0  # the worker's own deadlines end first (30 s for the namespace work)
MAX_REQUEST = 1 << 20
# The server's answer when it did nothing for the request (the hook's is one byte, its exit status): runs
# in-process. Status 255 starts it too, and is told apart by the end of the connection after it.
REFUSED = b"\xffrefused"


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


def _connect(path: str) -> "_socket.socket | None":
    """A connection to the hook server at `path` when one run by this very user answers (a socket somebody
    else could have put there is never used); None otherwise."""
    import _socket

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    except OSError:
        return None
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(path)
        peer = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        if int.from_bytes(peer[4:8], sys.byteorder) == posix.geteuid():
            return sock
    except OSError:
        pass
    sock.close()
    return None


def server_answers(path: str) -> bool:
    """Whether a hook server run by this user listens on `path` (it takes a connection that sends nothing
    as a probe, not as a request)."""
    sock = _connect(path)
    if sock is None:
        return False
    sock.close()
    return True


def run_via_server(args: list[str]) -> int | None:
    """The hook's exit status as the server's worker gives it; None when no server takes the request or
    the server refuses it."""
    path = server_socket(args[1:])
    if path is None:
        return None
    try:
        posix.stat(path)
    except OSError:
        return None
    sock = _connect(path)
    if sock is None:
        return None
    import _socket

    try:
        try:
            request = encode_request(args)
            if len(request) > MAX_REQUEST:
                return None
            fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2))
            sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        except OSError:
            return None  # nobody took it: run in-process
        sock.settimeout(REPLY_TIMEOUT)
        try:
            reply = sock.recv(len(REFUSED))
            while reply[:1] == REFUSED[:1] and len(reply) < len(REFUSED) and (more := sock.recv(len(REFUSED))):
                reply += more
        except OSError as err:
            reply, why = b"", f"no answer from the hook server {path}: {err}"
        else:
            why = f"the hook server {path} ended the request without an answer"
        if not reply:
            print(f"devinject: error: {why}", file=sys.stderr)
            return 1
        if reply == REFUSED:
            return None  # not in the server's namespaces: nothing was done, run in-process
        return reply[0]
    finally:
        sock.close()
