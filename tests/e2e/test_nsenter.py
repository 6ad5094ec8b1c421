"""The hook joins a container's mount namespace in its own process and comes back: into the namespace,
out again whatever happens inside (an error, running out of time), in the same working directory."""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devinject.core.errors import HookError
from devinject.hook.nsenter import in_mount_namespace
from tests.e2e.conftest import require, stand_ins

pytestmark = pytest.mark.live


def _mount_ns(pid: str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


def single_threaded(test: Callable[..., None]) -> Callable[..., None]:
    """The test in a forked child, single-threaded as the hook's process is: the kernel refuses a mount
    namespace to a process with more than one thread (setns: EINVAL), and pytest's own has more once another
    test used gRPC or Helm in it (their libraries' threads stay for good)."""

    @functools.wraps(test)
    def run(*args: object, **kwargs: object) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the test's outcome down the pipe, then gone without pytest's teardown
            os.close(read)
            try:
                test(*args, **kwargs)
                outcome = b"ok"
            except BaseException:
                outcome = traceback.format_exc().encode()
            os.write(write, outcome)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            outcome = pipe.read()
        os.waitpid(pid, 0)
        if outcome != b"ok":
            pytest.fail(outcome.decode() or "the test's process died", pytrace=False)

    return run


@pytest.fixture
def container() -> Iterator[int]:
    """A process in a mount namespace of its own, as a container's init is."""
    require(os.geteuid() == 0, "needs root (setns)")
    with stand_ins(1, "unshare", "-m", "--propagation", "private", "sleep", "60") as (process,):
        for _ in range(200):  # until unshare has exec'd sleep in the new namespace
            if _mount_ns(str(process.pid)) != _mount_ns():
                break
            time.sleep(0.01)
        yield process.pid


@single_threaded
def test_runs_in_the_container_namespace_and_comes_back(container: int, tmp_path: Path) -> None:
    os.chdir(tmp_path)
    home = _mount_ns()
    assert in_mount_namespace(container, _mount_ns) == _mount_ns(str(container)) != home
    assert _mount_ns() == home and os.getcwd() == str(tmp_path)


@single_threaded
def test_an_error_inside_comes_back_out_with_the_process(container: int) -> None:
    home = _mount_ns()

    def fails() -> None:
        raise HookError("inside")

    with pytest.raises(HookError, match="inside"):
        in_mount_namespace(container, fails)
    assert _mount_ns() == home


@single_threaded
def test_work_that_outlasts_its_deadline_is_interrupted_and_the_process_comes_back(container: int) -> None:
    import signal

    home = _mount_ns()
    before = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(HookError, match=r"did not finish in 0\.2s"):
        in_mount_namespace(container, lambda: time.sleep(10), timeout=0.2)
    assert time.monotonic() - started < 5
    assert _mount_ns() == home and signal.getsignal(signal.SIGALRM) == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@single_threaded
def test_a_gone_container_is_one_clear_error() -> None:
    with pytest.raises(HookError, match="cannot open the container process's mount namespace"):
        in_mount_namespace(2**22 + 1, lambda: None)
