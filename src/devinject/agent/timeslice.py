"""A GPU's time slice, set as NVIDIA's DRA driver sets it for a claim's `timeSlicingConfig.interval`: the driver
root's `nvidia-smi` puts the GPU in the DEFAULT compute mode (time-slicing needs it) and then
`compute-policy -i <UUID> --set-timeslice <n>` (Default 0, Short 1, Medium 2, Long 3). Each call has a
deadline and a bounded answer; one that fails is a TimesliceError naming the GPU and what nvidia-smi said (the
claim's error)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading

from devinject.agent.rootprogram import UntrustedProgramError, root_program
from devinject.core.errors import DevinjectError

NVIDIA_SMI = "/usr/bin/nvidia-smi"  # inside the driver root
TIMESLICES = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
TIMEOUT = 10.0  # seconds per nvidia-smi call
MAX_ANSWER = 400  # characters of its output kept for the error
MAX_KEPT = 4096  # bytes of its output read into memory; the rest is drained and dropped


class TimesliceError(DevinjectError):
    """An interval the node cannot apply: said in one line."""


def apply_timeslice(driver_root: str, gpu: str, uuid: str, interval: str, timeout: float = TIMEOUT) -> bool:
    """Set `gpu`'s (its PCI address, for the message) time slice to `interval` through its `uuid`. False when
    nothing was done: `Default` asked and the node has no nvidia-smi (nothing can have changed the slice
    either). TimesliceError when it cannot be applied."""
    if interval not in TIMESLICES:
        raise TimesliceError(f"{gpu}: time slice interval {interval!r}: expected one of {', '.join(TIMESLICES)}")
    try:  # it runs as root: resolved inside the driver root, and only root's (agent/rootprogram.py)
        program = root_program(driver_root, NVIDIA_SMI)
    except UntrustedProgramError as err:
        raise TimesliceError(f"{gpu}: interval {interval}: {err.message}") from None
    if program is None:
        if interval == "Default":
            return False
        raise TimesliceError(f"{gpu}: interval {interval}: {os.path.join(driver_root, NVIDIA_SMI)} is not there; "
                             "the node cannot set a time slice")
    if not uuid:
        raise TimesliceError(f"{gpu}: interval {interval}: the GPU's UUID is not known; nvidia-smi names it by it")
    for args in (["-i", uuid, "-c", "DEFAULT"],
                 ["compute-policy", "-i", uuid, "--set-timeslice", str(TIMESLICES[interval])]):
        _run(program, args, gpu, interval, timeout)
    return True


def _run(program: str, args: list[str], gpu: str, interval: str, timeout: float) -> None:
    """One nvidia-smi call within `timeout`, its output read up to MAX_KEPT bytes (the rest drained and
    dropped). On a wedged GPU nvidia-smi can sit in uninterruptible sleep, where a kill takes no effect: it is
    killed and left to a reaper thread, never waited for here (the caller may hold the claims' lock)."""
    try:
        process = subprocess.Popen([program, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                   start_new_session=True)
    except OSError as err:
        raise TimesliceError(f"{gpu}: interval {interval}: {program}: {err.strerror}") from None
    kept = bytearray()
    reader = threading.Thread(target=_drain, args=(process, kept), daemon=True)
    reader.start()
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # its session: children it left behind too
        threading.Thread(target=process.wait, daemon=True).start()  # reaped whenever it does exit
        raise TimesliceError(f"{gpu}: interval {interval}: nvidia-smi {' '.join(args)} did not answer within "
                             f"{timeout:g} s") from None
    reader.join(timeout=1.0)  # a child it left holding the pipe must not hold us either
    if status != 0:
        said = " ".join(bytes(kept).decode("utf-8", "replace").split())[:MAX_ANSWER]
        raise TimesliceError(f"{gpu}: interval {interval}: nvidia-smi {' '.join(args)} failed "
                             f"(status {status}): {said or 'no output'}")


def _drain(process: subprocess.Popen[bytes], kept: bytearray) -> None:
    assert process.stdout is not None
    with process.stdout:
        while chunk := process.stdout.read(4096):
            if len(kept) < MAX_KEPT:
                kept += chunk[:MAX_KEPT - len(kept)]
