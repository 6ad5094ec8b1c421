"""NVML's facts, read through pynvml from a real C library: the stub libnvidia-ml.so.1 that tests/nvmlstub
builds from a fixture host's data (the real ctypes calls, structs and error codes), with MIG on (dgx-a100-mig)
and off (hgx-h100); one that hangs proves the deadline, ones with fewer symbols the fallback."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from devinject.discovery import nvml
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.discovery.nvml import NO_FACTS, NvmlAnswerError, node_facts, parse_answer
from devinject.specs.generate import GenerateOptions, generate_specs
from tests.conftest import HOSTS

H100_UUID = "GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00"  # 0000:18:00.0 in the fixture's procfs


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(nvml, "_warned", set())


def test_gpu_facts_without_mig(nvml_host):
    facts = node_facts(Host(str(nvml_host("hgx-h100"))))
    assert (facts.driver_version, facts.cuda_driver_version) == ("550.54.14", "12.4")
    assert len(facts.gpus) == 8
    gpu = facts.gpu("0000:18:00.0")
    assert gpu is not None
    assert (gpu.uuid, gpu.product_name, gpu.brand, gpu.architecture) == (
        H100_UUID, "NVIDIA H100 80GB HBM3", "Nvidia", "Hopper")
    assert gpu.cuda_compute_capability == "9.0"
    assert gpu.memory_bytes == 81559 * 1024 * 1024
    assert gpu.board_part_number == "692-2G520-0200-000"
    assert gpu.serial and gpu.serial.isdigit()
    assert gpu.mig_mode is False and gpu.mig_devices == ()


def test_mig_devices_with_their_profiles(nvml_host):
    from tests.nvmlstub import host_gpus, mig_uuid

    facts = node_facts(Host(str(nvml_host("dgx-a100-mig"))))
    mig_gpu, whole = facts.gpu("0000:07:00.0"), facts.gpu("0000:87:00.0")
    assert mig_gpu is not None and whole is not None
    assert (mig_gpu.architecture, mig_gpu.brand, mig_gpu.cuda_compute_capability) == ("Ampere", "Tesla", "8.0")
    assert mig_gpu.mig_mode is True and whole.mig_mode is False and whole.mig_devices == ()
    stub_gpu = host_gpus(HOSTS / "dgx-a100-mig")[0]
    assert [(m.gpu_instance, m.compute_instance, m.profile, m.memory_bytes, m.uuid) for m in mig_gpu.mig_devices] == [
        (1, 0, "3g.40gb", 40192 * 1024 * 1024, mig_uuid(stub_gpu, 1, 0)),
        (2, 0, "3g.40gb", 40192 * 1024 * 1024, mig_uuid(stub_gpu, 2, 0))]


def _probes_of(library: Path) -> list[int]:
    """Processes still running the probe of `library`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"nvmlprobe" in cmdline and str(library).encode() in cmdline:
            found.append(int(pid))
    return found


def test_a_hanging_nvml_is_cut_off_at_its_deadline(nvml_host, caplog):
    root = nvml_host("hgx-h100", hang="nvmlDeviceGetMemoryInfo")  # a GPU that fell off the bus
    library = nvml.nvml_library(Host(str(root)))
    assert library is not None
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert node_facts(Host(str(root)), timeout=1.0) == NO_FACTS
    assert time.monotonic() - started < 30  # the stub never returns: only the deadline ends this
    assert "did not answer within 1s" in caplog.text
    assert _probes_of(Path(library)) == []  # killed, not left behind


def test_nvml_without_its_start_is_one_warning_and_no_facts(nvml_host, caplog):
    root = nvml_host("hgx-h100", omit=("nvmlInitWithFlags",))  # an NVML older than pynvml needs
    with caplog.at_level(logging.WARNING):
        assert node_facts(Host(str(root))) == NO_FACTS
        assert node_facts(Host(str(root))) == NO_FACTS  # the next rescan: said once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Function Not Found" in warnings[0], warnings


def test_a_fact_the_library_lacks_is_left_out_alone(nvml_host):
    root = nvml_host("hgx-h100", omit=("nvmlDeviceGetCudaComputeCapability",))
    gpu = node_facts(Host(str(root))).gpu("0000:18:00.0")
    assert gpu is not None and gpu.compute_capability is None
    assert gpu.memory_bytes == 81559 * 1024 * 1024 and gpu.uuid == H100_UUID


def test_no_library_is_a_warning(host_copy, caplog):
    root = host_copy("hgx-h100")  # its libnvidia-ml is a fixture's ELF without NVML's symbols
    with caplog.at_level(logging.WARNING):
        assert node_facts(Host(str(root))) == NO_FACTS
    assert "GPUs are described from sysfs only" in caplog.text


def test_the_driver_roots_library_not_our_own(nvml_host, nvml_stubs, tmp_path, monkeypatch):
    """NVML is the driver root's (a containerized driver), found as nvidia-ctk finds it; the agent's own
    library path (here: another node's stub on LD_LIBRARY_PATH) is never asked."""
    root = host_copy_without_nvml = nvml_host("hgx-h100", omit=("nvmlInitWithFlags",))  # the host's own: broken
    driver = root / "run/nvidia/driver/usr/lib64"
    driver.mkdir(parents=True)
    shutil.copyfile(nvml_stubs("hgx-h100"), driver / "libnvidia-ml.so.1")
    elsewhere = tmp_path / "agent-lib"
    elsewhere.mkdir()
    shutil.copyfile(nvml_stubs("dgx-a100-mig"), elsewhere / "libnvidia-ml.so.1")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(elsewhere))
    node = Node(str(host_copy_without_nvml), check=False)
    facts = node.nvml_facts(True, "/run/nvidia/driver")
    assert [g.product_name for g in facts.gpus] == ["NVIDIA H100 80GB HBM3"] * 8
    assert node.nvml_facts(True) == NO_FACTS  # the host root's own library fails: no facts, no error


def test_nvml_is_asked_once_per_read_of_the_node(nvml_host, monkeypatch):
    root = nvml_host("hgx-h100")
    calls = []
    real = nvml.read_nvml
    monkeypatch.setattr(nvml, "read_nvml", lambda *a, **k: calls.append(a) or real(*a, **k))
    node = Node(str(root), check=False, nvml=True)
    assert node.nvml_facts() is node.nvml_facts()
    assert len(calls) == 1
    node.rescanned().nvml_facts()
    assert len(calls) == 2


def test_nvml_is_off_by_default_off_the_host_root(nvml_host, monkeypatch):
    monkeypatch.setattr(nvml, "read_nvml", lambda *a, **k: pytest.fail("NVML asked"))
    assert Node(str(nvml_host("hgx-h100")), check=False).nvml_facts() == NO_FACTS


def test_nvml_fills_a_uuid_the_proc_file_lacks(nvml_host):
    root = nvml_host("hgx-h100")
    info = root / "proc/driver/nvidia/gpus/0000:18:00.0/information"
    info.write_text("\n".join(line for line in info.read_text().splitlines() if not line.startswith("GPU UUID")))
    (spec,) = [s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/x", nvml=True))
               if s.kind == "nvidia.com/gpu"]
    assert spec.device(H100_UUID) is not None
    (without,) = [s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/x", nvml=False))
                  if s.kind == "nvidia.com/gpu"]
    assert without.device("0000:18:00.0") is not None  # no UUID: index + pci names


def test_mig_devices_get_their_uuid_names_from_nvml(nvml_host):
    from tests.nvmlstub import host_gpus, mig_uuid

    root = nvml_host("dgx-a100-mig")
    first, second = (mig_uuid(host_gpus(HOSTS / "dgx-a100-mig")[0], gi, 0) for gi in (1, 2))
    (spec,) = [s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/x", nvml=True))
               if s.kind == "nvidia.com/gpu"]
    names = [d.name for d in spec.devices]
    assert names[:4] == ["0:0", first, "0:1", second]
    assert spec.device(second).edits == spec.device("0:1").edits
    (index_only,) = [s for s in generate_specs(GenerateOptions(root=str(root), hook_path="/x", nvml=True,
                                                               strategies=("index",))) if s.kind == "nvidia.com/gpu"]
    assert first not in [d.name for d in index_only.devices]


@pytest.mark.parametrize(("answer", "field"), [
    ('{"gpus": [{"uuid": "x"}]}', "gpus[0].busId"),
    ('{"gpus": [{"busId": "0000:18:00.0", "memoryBytes": "80G"}]}', "gpus[0].memoryBytes"),
    ('{"gpus": [{"busId": "0000:18:00.0", "cudaComputeCapability": "9"}]}', "gpus[0].cudaComputeCapability"),
    ('{"gpus": [{"busId": "0000:18:00.0", "migMode": 1}]}', "gpus[0].migMode"),
    ('{"gpus": {}}', "nvml.gpus"),
])
def test_a_wrong_answer_names_its_field(answer, field):
    with pytest.raises(NvmlAnswerError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_answer(answer)


def test_a_compute_instance_smaller_than_its_gpu_instance_is_named_as_nvidia_names_it() -> None:
    """A 3g.40gb GPU instance split into three 1-slice compute instances holds three MIG devices, each a
    `1c.3g.40gb` (NVIDIA's device plugin: nvidia.com/mig-1c.3g.40gb), not three `3g.40gb`: offered under the
    GPU instance's profile, a pod asking for a whole 3g.40gb would get a third of one."""
    from types import SimpleNamespace

    from devinject.discovery import nvmlprobe

    class NVMLError(Exception):
        pass

    cis = {0: 0, 1: 1, 2: 2}  # MIG device index -> its compute instance, all in GPU instance 1

    def attributes(mig: int) -> SimpleNamespace:
        return SimpleNamespace(gpuInstanceSliceCount=3, computeInstanceSliceCount=1 if mig < 3 else 3)

    fake = SimpleNamespace(
        NVMLError=NVMLError,
        nvmlDeviceGetMaxMigDeviceCount=lambda parent: 4,
        nvmlDeviceGetMigDeviceHandleByIndex=lambda parent, i: i,
        nvmlDeviceGetGpuInstanceId=lambda mig: 1 if mig < 3 else 2,
        nvmlDeviceGetComputeInstanceId=lambda mig: cis.get(mig, 0),
        nvmlDeviceGetGpuInstanceById=lambda parent, gi: gi,
        nvmlGpuInstanceGetInfo=lambda gi: SimpleNamespace(profileId=2),
        nvmlDeviceGetGpuInstanceProfileInfo=lambda parent, i: SimpleNamespace(
            id=i, name=b"MIG 3g.40gb", memorySizeMB=40192),
        nvmlDeviceGetAttributes=attributes,
        nvmlDeviceGetMemoryInfo=lambda mig: SimpleNamespace(total=1 << 30),
        nvmlDeviceGetUUID=lambda mig: f"MIG-{mig}")
    found = nvmlprobe._mig_devices(fake, "gpu")
    assert [(d["gpuInstance"], d["computeInstance"], d["profile"]) for d in found] == [
        (1, 0, "1c.3g.40gb"), (1, 1, "1c.3g.40gb"), (1, 2, "1c.3g.40gb"), (2, 0, "3g.40gb")]
