"""NVML is optional and bounded: a fake pynvml module stands in for the library."""

import sys
import threading
import time
import types

import pytest

from devinject.discovery.gpuinfo import nvml_gpus
from devinject.specs.generate import GenerateOptions, generate_specs


def fake_pynvml(*, hang: threading.Event | None = None, fail: bool = False, bus: bytes = b"00000000:18:00.0",
                mig: dict[tuple[int, int], str] | None = None) -> types.ModuleType:
    """NVML's Python API as pynvml exposes it; `mig`: the GPU's MIG devices by (GI, CI) -> UUID."""
    module = types.ModuleType("pynvml")
    migs = list((mig or {}).items())

    def mig_count(handle: object) -> int:
        if mig is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 7  # the maximum; indexes without a device raise, as NVML's do

    def mig_handle(handle: object, index: int) -> int:
        if index >= len(migs):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return 100 + index

    def init() -> None:
        if fail:
            raise RuntimeError("NVML Shared Library Not Found")
        if hang is not None:
            hang.wait(30)  # a GPU that fell off the bus

    class PciInfo:
        busId = bus

    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetPciInfo = lambda handle: PciInfo()
    module.nvmlDeviceGetUUID = lambda handle: migs[handle - 100][1] if handle >= 100 else "GPU-from-nvml-0000"
    module.nvmlDeviceGetMaxMigDeviceCount = mig_count
    module.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    module.nvmlDeviceGetGpuInstanceId = lambda handle: migs[handle - 100][0][0]
    module.nvmlDeviceGetComputeInstanceId = lambda handle: migs[handle - 100][0][1]
    module.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    return module


@pytest.fixture
def with_pynvml(monkeypatch):
    def install(module: types.ModuleType) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", module)

    return install


def test_nvml_answers_by_bus_id(with_pynvml):
    with_pynvml(fake_pynvml())
    gpus = nvml_gpus()
    assert gpus["0000:18:00.0"].uuid == "GPU-from-nvml-0000"
    assert gpus["0000:18:00.0"].name == "NVIDIA H100 80GB HBM3"


def test_hanging_nvml_is_bounded(with_pynvml):
    release = threading.Event()
    with_pynvml(fake_pynvml(hang=release))
    started = time.monotonic()
    assert nvml_gpus(timeout=0.3) == {}
    assert time.monotonic() - started < 2
    release.set()


def test_missing_nvml_is_not_an_error(with_pynvml):
    with_pynvml(fake_pynvml(fail=True))
    assert nvml_gpus() == {}


def test_nvml_fills_a_uuid_the_proc_file_lacks(with_pynvml, host_copy):
    root = host_copy("hgx-h100")
    info = root / "proc/driver/nvidia/gpus/0000:18:00.0/information"
    info.write_text("\n".join(line for line in info.read_text().splitlines() if not line.startswith("GPU UUID")))
    with_pynvml(fake_pynvml())
    (spec,) = [s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/x", nvml=True))
               if s.kind == "nvidia.com/gpu"]
    assert spec.device("GPU-from-nvml-0000") is not None
    (without,) = [s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/x", nvml=False))
                  if s.kind == "nvidia.com/gpu"]
    assert without.device("0000:18:00.0") is not None  # no UUID: index + pci names


def test_mig_devices_get_their_uuid_names_from_nvml(with_pynvml):
    from tests.conftest import HOSTS

    with_pynvml(fake_pynvml(bus=b"00000000:07:00.0", mig={(1, 0): "MIG-1111", (2, 0): b"MIG-2222"}))
    (spec,) = [s for s in generate_specs(GenerateOptions(root=str(HOSTS / "dgx-a100-mig"), hook_path="/x",
                                                         nvml=True)) if s.kind == "nvidia.com/gpu"]
    names = [d.name for d in spec.devices]
    assert names[:4] == ["0:0", "MIG-1111", "0:1", "MIG-2222"]
    assert spec.device("MIG-2222").edits == spec.device("0:1").edits
    (index_only,) = [s for s in generate_specs(GenerateOptions(root=str(HOSTS / "dgx-a100-mig"), hook_path="/x",
                                                               nvml=True, strategies=("index",)))
                     if s.kind == "nvidia.com/gpu"]
    assert "MIG-1111" not in [d.name for d in index_only.devices]
