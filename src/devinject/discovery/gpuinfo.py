"""Optional NVML enrichment. pynvml is imported lazily; absence or failure is never an error.

A GPU that fell off the bus can hang NVML forever, so every query runs in a daemon thread with a deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
NVML_TIMEOUT = 5.0


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


class NvmlGpu(NamedTuple):
    bus_id: str
    uuid: str
    name: str
    mig: dict[tuple[int, int], str] = {}  # (GPU instance, compute instance) -> MIG device UUID


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mig_uuids(pynvml: Any, handle: object) -> dict[tuple[int, int], str]:
    """The MIG devices of a GPU by (GI, CI); {} for a GPU without MIG (NVML raises NotSupported)."""
    out: dict[tuple[int, int], str] = {}
    try:
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:
        return out
    for index in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            key = (int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                   int(pynvml.nvmlDeviceGetComputeInstanceId(mig)))
            out[key] = _text(pynvml.nvmlDeviceGetUUID(mig))
        except Exception:
            continue  # an index with no MIG device behind it
    return out


def _query() -> dict[str, NvmlGpu]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            bus_id = bus.lower()[-12:]  # NVML pads the domain to 8 digits
            out[bus_id] = NvmlGpu(bus_id, _text(pynvml.nvmlDeviceGetUUID(handle)),
                                  _text(pynvml.nvmlDeviceGetName(handle)), _mig_uuids(pynvml, handle))
        return out
    finally:
        pynvml.nvmlShutdown()


def nvml_gpus(timeout: float = NVML_TIMEOUT) -> dict[str, NvmlGpu]:
    """GPUs by PCI address (`0000:18:00.0`), or {} when NVML is absent, fails or hangs."""
    try:
        return call_with_timeout(_query, timeout)
    except ProbeTimeout:
        log.warning("NVML did not answer within %gs; continuing without it", timeout)
    except Exception as err:  # ImportError, NVMLError_LibraryNotFound, ...
        log.info("NVML unavailable: %s", err)
    return {}
