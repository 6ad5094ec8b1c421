"""The hook server's refusal: a peer outside its namespaces gets REFUSED before anything is done, and the
hook's client runs such a request in-process (tests/e2e/test_hook_server_namespaces.py does it under runc)."""

from __future__ import annotations

import array
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.hook import server
from devinject.hook.client import REFUSED, encode_request, run_via_server


def _elsewhere(kind: str) -> server.Namespaces:
    """This process's namespaces, as if `kind` were another one."""
    own = server.namespaces_of("self")
    return tuple((dev, ino + 1) if name == kind else (dev, ino)
                 for name, (dev, ino) in zip(server.NAMESPACES, own, strict=True))


def test_a_peer_in_the_servers_namespaces_is_served_and_one_elsewhere_is_told_which_differ() -> None:
    one, other = socket.socketpair()
    with one, other:
        own = server.namespaces_of("self")
        assert server.refusal(one, os.getpid(), own) is None
        for kind in server.NAMESPACES:
            assert server.refusal(one, os.getpid(), _elsewhere(kind)) == \
                f"pid {os.getpid()} is not in the hook server's namespaces ({kind})"
        assert server.refusal(one, 0, own) == "its pid namespace is not the hook server's"  # SO_PEERCRED's 0
        other.close()
        assert server.refusal(one, os.getpid(), own) == f"pid {os.getpid()} hung up"  # nobody waits for it


def test_a_refused_request_is_answered_refused_and_nothing_runs(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from devinject.hook import main as hook

    ran: list[list[str]] = []
    monkeypatch.setattr(hook, "main", lambda args: ran.append(args) or 0)
    home = server.Home()  # a worker's, made before it waits: its descriptors are not the request's
    let_go: list[bool] = []
    one, other = socket.socketpair()
    pipe_r, pipe_w = os.pipe()
    before = set(os.listdir("/proc/self/fd"))
    with one, other:
        fds = array.array("i", [pipe_r, pipe_w, pipe_w]).tobytes()
        request = encode_request(["hook", "--log-file", "/dev/null"])
        other.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        with caplog.at_level(logging.WARNING, "devinject.hook-server"):
            again = server._take(one, _elsewhere("pid"), home, last=lambda: let_go.append(True))
        other.settimeout(5)
        assert other.recv(64) == REFUSED
        assert set(os.listdir("/proc/self/fd")) == before  # the runtime's stdin, stdout, stderr let go
    os.close(pipe_r)
    os.close(pipe_w)
    home.close()
    assert ran == [] and let_go == []
    assert again  # nothing ran: the worker waits for the next request
    assert [r.getMessage() for r in caplog.records] == \
        [f"hook request refused, to be run in-process: pid {os.getpid()} is not in the hook server's namespaces (pid)"]


@pytest.fixture
def answering() -> Iterator[tuple[Path, list[bytes]]]:
    """A server at a socket that answers each request with the next of the replies put in the list."""
    directory = Path(tempfile.mkdtemp(prefix="di-", dir="/tmp"))
    path = directory / "s.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(4)
    replies: list[bytes] = []

    def answer() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                _, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
                for cmsg in ancillary:
                    for fd in array.array("i", cmsg[2]):
                        os.close(fd)
                conn.sendall(replies.pop(0))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield path, replies
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
        path.unlink()
        directory.rmdir()


def test_the_client_runs_a_refused_request_in_process_and_takes_any_one_byte_as_the_status(
        answering: tuple[Path, list[bytes]]) -> None:
    path, replies = answering
    replies += [REFUSED, b"\xff", b"\x00", b"\x02"]
    args = ["hook", "--server", str(path)]
    assert run_via_server(args) is None  # refused: in-process
    assert run_via_server(args) == 255  # a status that starts like REFUSED, then the end of the connection
    assert run_via_server(args) == 0
    assert run_via_server(args) == 2
