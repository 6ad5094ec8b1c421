"""A stub `libnvidia-ml.so.1` built in C from a fixture host's data, so that pynvml and its ctypes calls run
as they do on a node.

The host gives what it holds (its GPUs' bus ids, models, UUIDs, minors, the driver's version, the MIG GPU
and compute instances under /proc/driver/nvidia/capabilities); the model table below gives what an NVML of
that GPU answers beyond it (brand, architecture, compute capability, memory, MIG profiles). Every function
pynvml can call and nvml_stub.c does not model is generated answering NVML_ERROR_NOT_SUPPORTED; `omit`
leaves symbols out of the library (an older NVML), `hang` names a call that never returns.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "nvml_stub.c"
SONAME = "libnvidia-ml.so.1"
CUDA_VERSION = 12040  # what a 550 driver's NVML answers (CUDA 12.4)
MIB = 1024 * 1024

# nvmlBrandType_t and nvmlDeviceArchitecture_t values (nvml.h)
BRAND_TESLA, BRAND_NVIDIA = 2, 14
ARCH_AMPERE, ARCH_HOPPER = 7, 9


@dataclass(frozen=True)
class Model:
    brand: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int
    part_number: str
    profiles: tuple[tuple[int, str, int, int], ...]  # (profile index, name, slices, memory MiB)


MODELS = {
    "NVIDIA H100 80GB HBM3": Model(BRAND_NVIDIA, ARCH_HOPPER, (9, 0), 81559, "692-2G520-0200-000", (
        (0, "1g.10gb", 1, 9856), (1, "2g.20gb", 2, 20096), (2, "3g.40gb", 3, 40320), (3, "4g.40gb", 4, 40320),
        (4, "7g.80gb", 7, 80768), (9, "1g.20gb", 1, 20096))),
    "NVIDIA A100-SXM4-80GB": Model(BRAND_TESLA, ARCH_AMPERE, (8, 0), 81920, "692-2G506-0210-002", (
        (0, "1g.10gb", 1, 9728), (1, "2g.20gb", 2, 19968), (2, "3g.40gb", 3, 40192), (3, "4g.40gb", 4, 40192),
        (4, "7g.80gb", 7, 80896))),
}
# which profile a fixture's GPU instances were made with: the A100's GIs 1 and 2 are two 3g.40gb
MIG_PROFILE_BY_SLICES = {"NVIDIA A100-SXM4-80GB": 2, "NVIDIA H100 80GB HBM3": 2}


@dataclass(frozen=True)
class StubGpu:
    bus_id: str
    model: str
    uuid: str
    minor: int
    device_id: int
    migs: tuple[tuple[int, int], ...]  # (GI, CI) from the capability dirs


def _key_values(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def host_gpus(root: Path) -> list[StubGpu]:
    """The host's NVIDIA GPUs in NVML's order (by PCI address), from procfs and sysfs."""
    gpus = []
    for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
        values = _key_values(info.read_text())
        bus_id = values["Bus Location"].lower()
        minor = int(values["Device Minor"])
        caps = root / f"proc/driver/nvidia/capabilities/gpu{minor}/mig"
        migs = tuple(sorted((int(gi.name[2:]), int(ci.name[2:]))
                            for gi in caps.glob("gi*") for ci in gi.glob("ci*")))
        device = (root / f"sys/bus/pci/devices/{bus_id}/device")
        device_id = int(device.read_text(), 16) if device.exists() else 0
        gpus.append(StubGpu(bus_id, values["Model"], values.get("GPU UUID", ""), minor, device_id, migs))
    return sorted(gpus, key=lambda g: g.bus_id)


def driver_version(root: Path) -> str:
    text = (root / "proc/driver/nvidia/version").read_text()
    found = re.search(r"Kernel Module\s+(\S+)", text)
    assert found, "the fixture's /proc/driver/nvidia/version names no version"
    return found.group(1)


def mig_uuid(gpu: StubGpu, gi: int, ci: int) -> str:
    digest = hashlib.sha256(f"{gpu.uuid}/{gi}/{ci}".encode()).hexdigest()
    return f"MIG-{digest[:8]}-{digest[8:12]}-5{digest[13:16]}-8{digest[17:20]}-{digest[20:32]}"


def serial(gpu: StubGpu) -> str:
    return f"16549220{int(gpu.bus_id[5:7], 16):05d}"


def _c(text: str | None) -> str:
    return "NULL" if text is None else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def data_header(root: Path) -> str:
    """stub_data.h: the host's GPUs as the stub answers for them."""
    rows = []
    for gpu in host_gpus(root):
        model = MODELS[gpu.model]
        profile = MIG_PROFILE_BY_SLICES[gpu.model]
        migs = ", ".join(f"{{{gi}, {ci}, {profile}, {_c(mig_uuid(gpu, gi, ci))}}}" for gi, ci in gpu.migs)
        profiles = ", ".join(f"{{{index}, {_c(name)}, {slices}, {mib}}}" for index, name, slices, mib in model.profiles)
        rows.append(
            f"    {{{_c(gpu.bus_id)}, 0x{gpu.device_id:04x}10de, {_c(gpu.uuid)}, {_c(gpu.model)}, {_c(serial(gpu))}, "
            f"{_c(model.part_number)}, {gpu.minor}, {model.brand}, {model.architecture}, "
            f"{model.compute_capability[0]}, {model.compute_capability[1]}, {model.memory_mib}, "
            f"{1 if gpu.migs else 0}, {len(gpu.migs)}, {{{migs}}}, {len(model.profiles)}, {{{profiles}}}}},")
    version = driver_version(root)
    return "\n".join([
        f"#define STUB_DRIVER_VERSION {_c(version)}",
        f"#define STUB_NVML_VERSION {_c('12.' + version)}",
        f"#define STUB_CUDA_VERSION {CUDA_VERSION}",
        "static const struct stub_gpu stub_gpus[] = {", *rows, "};", ""])


def nvml_functions() -> list[str]:
    """Every NVML function pynvml can call (the names its ctypes lookups ask the library for)."""
    import pynvml

    text = Path(pynvml.__file__).read_text()
    return sorted(set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', text)))


def modelled_functions() -> list[str]:
    text = SOURCE.read_text()
    return sorted(set(re.findall(r"^(?:nvmlReturn_t |const char \*|[A-Z_]+\()(nvml\w+)[(,]", text, re.M)))


def build_stub(out: Path, root: Path, *, hang: str | None = None, omit: Iterable[str] = ()) -> Path:
    """Compile the stub for the host at `root` into `out`; `hang`: a call that never returns; `omit`: NVML
    functions the library does not export. Returns the library's path."""
    omitted = set(omit)
    modelled = modelled_functions()
    unmodelled = [name for name in nvml_functions() if name not in modelled]
    out.mkdir(parents=True, exist_ok=True)
    (out / "stub_data.h").write_text(data_header(root))
    (out / "stub_unmodelled.h").write_text("".join(
        f"nvmlReturn_t {name}(void) {{ hang_point(__func__); return NVML_ERROR_NOT_SUPPORTED; }}\n"
        for name in unmodelled))
    exported = sorted(set(modelled + unmodelled) - omitted)
    (out / "exports.map").write_text("{\n  global:\n" + "".join(f"    {n};\n" for n in exported) + "  local: *;\n};\n")
    library = out / SONAME
    command = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", str(out),
               f"-Wl,-soname,{SONAME}", f"-Wl,--version-script={out / 'exports.map'}", "-o", str(library),
               str(SOURCE)]
    if hang:
        command.insert(1, f'-DSTUB_HANG="{hang}"')
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return library


def install_stub(root: Path, library: Path) -> Path:
    """Put `library` where the host at `root` keeps its libnvidia-ml (the file its SONAME link ends at)."""
    link = root / "usr/lib/x86_64-linux-gnu" / SONAME
    target = link.parent / link.readlink() if link.is_symlink() else link
    target.unlink()
    shutil.copyfile(library, target)
    return target
