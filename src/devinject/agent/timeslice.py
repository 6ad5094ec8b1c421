"""A GPU's time slice, set as NVIDIA's DRA driver sets it for a claim's `timeSlicingConfig.interval`: the driver
root's `nvidia-smi` puts the GPU in the DEFAULT compute mode (time-slicing needs it) and then
`compute-policy -i <UUID> --set-timeslice <n>` (Default 0, Short 1, Medium 2, Long 3). Each call has a
deadline and a bounded answer; one that fails is a TimesliceError naming the GPU and what nvidia-smi said (the
claim's error)."""

from __future__ import annotations

import os
import subprocess

from devinject.core.errors import DevinjectError

NVIDIA_SMI = "usr/bin/nvidia-smi"  # under the driver root
TIMESLICES = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
TIMEOUT = 10.0  # seconds per nvidia-smi call
MAX_ANSWER = 400  # characters of its output kept for the error


class TimesliceError(DevinjectError):
    """An interval the node cannot apply: said in one line."""


def apply_timeslice(driver_root: str, gpu: str, uuid: str, interval: str, timeout: float = TIMEOUT) -> bool:
    """Set `gpu`'s (its PCI address, for the message) time slice to `interval` through its `uuid`. False when
    nothing was done: `Default` asked and the node has no nvidia-smi (nothing can have changed the slice
    either). TimesliceError when it cannot be applied."""
    if interval not in TIMESLICES:
        raise TimesliceError(f"{gpu}: time slice interval {interval!r}: expected one of {', '.join(TIMESLICES)}")
    program = os.path.join(driver_root, NVIDIA_SMI)
    if not os.access(program, os.X_OK):
        if interval == "Default":
            return False
        raise TimesliceError(f"{gpu}: interval {interval}: {program} is not there; the node cannot set a time slice")
    if not uuid:
        raise TimesliceError(f"{gpu}: interval {interval}: the GPU's UUID is not known; nvidia-smi names it by it")
    for args in (["-i", uuid, "-c", "DEFAULT"],
                 ["compute-policy", "-i", uuid, "--set-timeslice", str(TIMESLICES[interval])]):
        _run(program, args, gpu, interval, timeout)
    return True


def _run(program: str, args: list[str], gpu: str, interval: str, timeout: float) -> None:
    try:
        done = subprocess.run([program, *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except subprocess.TimeoutExpired:
        raise TimesliceError(f"{gpu}: interval {interval}: nvidia-smi {' '.join(args)} did not answer within "
                             f"{timeout:g} s") from None
    except OSError as err:
        raise TimesliceError(f"{gpu}: interval {interval}: {program}: {err.strerror}") from None
    if done.returncode != 0:
        said = " ".join((done.stdout + done.stderr).decode("utf-8", "replace").split())[:MAX_ANSWER]
        raise TimesliceError(f"{gpu}: interval {interval}: nvidia-smi {' '.join(args)} failed "
                             f"(status {done.returncode}): {said or 'no output'}")
