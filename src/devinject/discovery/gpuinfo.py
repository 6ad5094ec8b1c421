"""A probe of a device under a deadline: a GPU that fell off the bus can hang a read of its files, so the
health checks run each probe in a daemon thread and go on without it when it has not answered in time.
(NVML's facts are read in a child process instead, which can be killed: discovery/nvml.py.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ProbeTimeout(Exception):
    pass


def call_with_timeout(fn: Callable[[], T], timeout: float) -> T:
    """Run `fn` in a daemon thread; raise ProbeTimeout if it has not returned after `timeout` seconds."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # handed to the caller
            failure.append(err)

    thread = threading.Thread(target=run, name="devinject-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ProbeTimeout(f"probe timed out after {timeout:g}s")
    if failure:
        raise failure[0]
    return result[0]
