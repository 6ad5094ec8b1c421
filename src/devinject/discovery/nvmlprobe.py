"""The child that asks NVML (`python -m devinject.discovery.nvmlprobe LIBRARY`): it loads the libnvidia-ml at
LIBRARY through pynvml, writes the node's facts as one JSON document on stdout (nvml.parse_answer reads it)
and exits 0; on failure it writes one line saying why and exits 1. Run only by nvml.read_nvml, which kills
it at its deadline: nothing here needs one of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# nvmlDeviceArchitecture_t, nvmlBrandType_t (nvml.h), named as NVIDIA's DRA driver names them
ARCHITECTURES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
                 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell"}
BRANDS = {0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
          7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
          12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX"}
GPU_INSTANCE_PROFILES = 16  # profile indexes asked for a GPU instance's profile name (NVML has 0..14 today)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _maybe(pynvml: Any, call: Callable[[], T]) -> T | None:
    """One fact; None when this GPU or this library does not give it (NOT_SUPPORTED, a missing symbol)."""
    try:
        return call()
    except pynvml.NVMLError:
        return None


def _profile_names(pynvml: Any, parent: object) -> dict[int, tuple[str, int]]:
    """The GPU's MIG profiles: profile id -> (name without `MIG `, memory in MiB)."""
    out: dict[int, tuple[str, int]] = {}
    for index in range(GPU_INSTANCE_PROFILES):
        info = _maybe(pynvml, lambda i=index: pynvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, i))  # type: ignore[misc]
        if info is not None:
            out[int(info.id)] = (_text(info.name).removeprefix("MIG ").strip(), int(info.memorySizeMB))
    return out


def _with_compute_slices(pynvml: Any, mig: object, profile: str) -> str | None:
    """A MIG device's profile: its GPU instance's (`3g.40gb`), or `1c.3g.40gb` for a compute instance of fewer
    slices than its GPU instance, as NVIDIA's device plugin names it; None when NVML does not say which."""
    attributes = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetAttributes(mig))
    if attributes is None:
        return None  # a compute instance's share of its GPU instance unknown: no profile, never a wrong one
    compute, gpu = int(attributes.computeInstanceSliceCount), int(attributes.gpuInstanceSliceCount)
    return f"{compute}c.{profile}" if 0 < compute < gpu else profile


def _mig_devices(pynvml: Any, parent: object) -> list[dict[str, object]]:
    count = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(parent)) or 0
    profiles: dict[int, tuple[str, int]] | None = None
    out: list[dict[str, object]] = []
    for index in range(count):
        mig = _maybe(pynvml, lambda i=index: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, i))  # type: ignore[misc]
        if mig is None:
            continue  # an index with no MIG device behind it
        gi = _maybe(pynvml, lambda m=mig: pynvml.nvmlDeviceGetGpuInstanceId(m))  # type: ignore[misc]
        ci = _maybe(pynvml, lambda m=mig: pynvml.nvmlDeviceGetComputeInstanceId(m))  # type: ignore[misc]
        if gi is None or ci is None:
            continue
        profile = None
        instance = _maybe(pynvml, lambda g=gi: pynvml.nvmlDeviceGetGpuInstanceById(parent, g))  # type: ignore[misc]
        info = None if instance is None else _maybe(pynvml, lambda s=instance: pynvml.nvmlGpuInstanceGetInfo(s))  # type: ignore[misc]
        if info is not None:
            if profiles is None:
                profiles = _profile_names(pynvml, parent)
            named = profiles.get(int(info.profileId))
            profile = named[0] if named else None
        if profile is not None:
            profile = _with_compute_slices(pynvml, mig, profile)
        memory = _maybe(pynvml, lambda m=mig: pynvml.nvmlDeviceGetMemoryInfo(m))  # type: ignore[misc]
        uuid = _maybe(pynvml, lambda m=mig: pynvml.nvmlDeviceGetUUID(m))  # type: ignore[misc]
        out.append({"gpuInstance": int(gi), "computeInstance": int(ci),
                    "uuid": None if uuid is None else _text(uuid), "profile": profile,
                    "memoryBytes": None if memory is None else int(memory.total)})
    return out


def _gpu(pynvml: Any, handle: object) -> dict[str, object]:
    bus = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId).lower()
    bus_id = bus[-12:]  # NVML pads the domain to 8 digits
    cc = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    memory = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    arch = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetArchitecture(handle))
    brand = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetBrand(handle))
    mig_mode = _maybe(pynvml, lambda: pynvml.nvmlDeviceGetMigMode(handle))
    strings = {key: _maybe(pynvml, lambda f=fn: _text(f(handle)))  # type: ignore[misc]
               for key, fn in (("uuid", pynvml.nvmlDeviceGetUUID), ("productName", pynvml.nvmlDeviceGetName),
                               ("serial", pynvml.nvmlDeviceGetSerial),
                               ("boardPartNumber", pynvml.nvmlDeviceGetBoardPartNumber))}
    mig_on = None if mig_mode is None else bool(mig_mode[0])
    return {"busId": bus_id, **strings,
            "brand": None if brand is None else BRANDS.get(int(brand), "Unknown"),
            "architecture": None if arch is None else ARCHITECTURES.get(int(arch), "Unknown"),
            "cudaComputeCapability": None if cc is None else f"{int(cc[0])}.{int(cc[1])}",
            "memoryBytes": None if memory is None else int(memory.total),
            "migMode": mig_on, "migDevices": _mig_devices(pynvml, handle) if mig_on else []}


def _cuda_version(value: int | None) -> str | None:
    """NVML's 12040 -> `12.4`."""
    return None if value is None else f"{value // 1000}.{value % 1000 // 10}"


def probe(library: str) -> dict[str, object]:
    from ctypes import CDLL

    import pynvml

    pynvml.nvmlLib = CDLL(library)  # this file, not the first libnvidia-ml.so.1 on our own library path
    pynvml.nvmlInit()
    try:
        gpus = [_gpu(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
        driver = _maybe(pynvml, pynvml.nvmlSystemGetDriverVersion)
        return {"driverVersion": None if driver is None else _text(driver),
                "cudaDriverVersion": _cuda_version(_maybe(pynvml, pynvml.nvmlSystemGetCudaDriverVersion)),
                "gpus": gpus}
    finally:
        _maybe(pynvml, pynvml.nvmlShutdown)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m devinject.discovery.nvmlprobe LIBRARY")
        return 2
    try:
        facts = probe(argv[0])
    except Exception as err:  # the library missing, NVML refusing to start: one line for the warning
        print(f"{type(err).__name__}: {err}".replace("\n", " "))
        return 1
    import json

    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
