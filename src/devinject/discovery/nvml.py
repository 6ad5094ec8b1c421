"""A node's NVML facts: what each NVIDIA GPU and MIG device is (product, architecture, compute capability,
memory, ...), read from the driver's own `libnvidia-ml.so.1` under the host or driver root.

NVML is asked in a child process (`discovery/nvmlprobe.py`) that is killed at its deadline: a GPU that fell off
the bus can hang an NVML call in the kernel, and a thread stuck in C can be neither stopped nor joined, so the
caller (the agent's rescan) would keep one more wedged thread per rescan. The child loads the library found
as nvidia-ctk finds it (the root's ld.so.cache, then the usual library folders), never the agent's own
library path. Absent or failing NVML is one warning per reason and no facts, never an error.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from devinject.core import jsonlite
from devinject.core.deadline import TooLarge, read_to_eof
from devinject.discovery.host import Host

log = logging.getLogger(__name__)

NVML_SONAME = "libnvidia-ml.so.1"
NVML_TIMEOUT = 10.0  # one read of every GPU, the probe's start included; a wedged GPU never answers
ANSWER_LIMIT = 1 << 20  # 1 MiB: a few KiB per GPU
# Where nvidia-ctk's library locator looks when the ld.so.cache names no libnvidia-ml (pkg/lookup/library.go)
LIBRARY_DIRS = ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64",
                "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib", "/lib")

_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class MigFacts:
    """One MIG device as NVML describes it."""

    gpu_instance: int
    compute_instance: int
    uuid: str | None = None
    profile: str | None = None  # `1g.10gb`, as NVIDIA's device plugin and DRA driver name it
    memory_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class GpuFacts:
    """One GPU as NVML describes it; a fact NVML does not give (NOT_SUPPORTED, an older library) is None."""

    bus_id: str  # `0000:18:00.0`, as sysfs names it
    uuid: str | None = None
    product_name: str | None = None
    brand: str | None = None
    architecture: str | None = None
    compute_capability: tuple[int, int] | None = None
    memory_bytes: int | None = None
    serial: str | None = None
    board_part_number: str | None = None
    mig_mode: bool | None = None
    mig_devices: tuple[MigFacts, ...] = ()

    @property
    def cuda_compute_capability(self) -> str | None:
        """`9.0`; None when NVML did not say."""
        return None if self.compute_capability is None else "{}.{}".format(*self.compute_capability)

    def mig(self, gpu_instance: int, compute_instance: int) -> MigFacts | None:
        for mig in self.mig_devices:
            if (mig.gpu_instance, mig.compute_instance) == (gpu_instance, compute_instance):
                return mig
        return None


@dataclass(frozen=True, slots=True)
class NvmlFacts:
    """What NVML said of the node: its driver and CUDA driver versions and its GPUs by PCI address."""

    driver_version: str | None = None
    cuda_driver_version: str | None = None  # `12.4`
    gpus: tuple[GpuFacts, ...] = ()

    def gpu(self, bus_id: str) -> GpuFacts | None:
        for gpu in self.gpus:
            if gpu.bus_id == bus_id:
                return gpu
        return None


NO_FACTS = NvmlFacts()

# GPU feature discovery's `gpu.family` by CUDA compute capability major (and minor where it splits a major)
_FAMILIES = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 7: "volta", 8: "ampere", 9: "hopper"}


def architecture_family(gpu: GpuFacts) -> str | None:
    """`ampere`, as NVIDIA's GPU feature discovery labels `nvidia.com/gpu.family`: from the compute capability
    (7.5 and up `turing`, 8.9 and up `ada-lovelace`), else NVML's architecture name in lower case (a GPU newer
    than the table: `blackwell`); None when NVML gives neither."""
    if gpu.compute_capability is not None:
        major, minor = gpu.compute_capability
        if major == 7 and minor >= 5:
            return "turing"
        if major == 8 and minor >= 9:
            return "ada-lovelace"
        if major in _FAMILIES:
            return _FAMILIES[major]
    known = gpu.architecture not in (None, "Unknown")
    return gpu.architecture.lower().replace(" ", "-") if gpu.architecture and known else None


def mig_resource(kind: str, profile: str) -> str:
    """`nvidia.com/mig-1g.10gb`: the name NVIDIA's device plugin and GPU feature discovery give the MIG devices
    of a profile, in the kind's vendor domain."""
    return f"{kind.partition('/')[0]}/mig-{profile}"


class NvmlAnswerError(ValueError):
    """The probe's answer is not what it writes (a field named)."""


def _field(obj: dict[str, object], name: str, kind: type, where: str) -> object:
    value = obj.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool)):
        raise NvmlAnswerError(f"{where}.{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _str(obj: dict[str, object], name: str, where: str) -> str | None:
    value = _field(obj, name, str, where)
    return value if isinstance(value, str) else None


def _int(obj: dict[str, object], name: str, where: str) -> int | None:
    value = _field(obj, name, int, where)
    return value if isinstance(value, int) else None


def _objects(obj: dict[str, object], name: str, where: str) -> list[dict[str, object]]:
    value = obj.get(name, [])
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise NvmlAnswerError(f"{where}.{name}: expected a list of objects")
    return value


def _capability(text: str | None, where: str) -> tuple[int, int] | None:
    if text is None:
        return None
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise NvmlAnswerError(f"{where}.cudaComputeCapability: expected MAJOR.MINOR, got {text!r}")
    return int(major), int(minor)


def parse_answer(text: str | bytes) -> NvmlFacts:
    """The probe's JSON answer (nvmlprobe.py writes it) as facts; NvmlAnswerError naming the field otherwise."""
    try:
        doc = jsonlite.loads(text)
    except ValueError as err:
        raise NvmlAnswerError(f"not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise NvmlAnswerError("expected an object")
    gpus = []
    for i, gpu in enumerate(_objects(doc, "gpus", "nvml")):
        where = f"gpus[{i}]"
        bus_id = _str(gpu, "busId", where)
        if bus_id is None:
            raise NvmlAnswerError(f"{where}.busId: missing")
        migs = tuple(
            MigFacts(gpu_instance=_int(mig, "gpuInstance", f"{where}.migDevices[{j}]") or 0,
                     compute_instance=_int(mig, "computeInstance", f"{where}.migDevices[{j}]") or 0,
                     uuid=_str(mig, "uuid", f"{where}.migDevices[{j}]"),
                     profile=_str(mig, "profile", f"{where}.migDevices[{j}]"),
                     memory_bytes=_int(mig, "memoryBytes", f"{where}.migDevices[{j}]"))
            for j, mig in enumerate(_objects(gpu, "migDevices", where)))
        mig_mode = _field(gpu, "migMode", bool, where)
        gpus.append(GpuFacts(
            bus_id=bus_id, uuid=_str(gpu, "uuid", where), product_name=_str(gpu, "productName", where),
            brand=_str(gpu, "brand", where), architecture=_str(gpu, "architecture", where),
            compute_capability=_capability(_str(gpu, "cudaComputeCapability", where), where),
            memory_bytes=_int(gpu, "memoryBytes", where), serial=_str(gpu, "serial", where),
            board_part_number=_str(gpu, "boardPartNumber", where),
            mig_mode=mig_mode if isinstance(mig_mode, bool) else None, mig_devices=migs))
    return NvmlFacts(driver_version=_str(doc, "driverVersion", "nvml"),
                     cuda_driver_version=_str(doc, "cudaDriverVersion", "nvml"), gpus=tuple(gpus))


def nvml_library(files: Host) -> str | None:
    """The real path of the `libnvidia-ml.so.1` under `files` (the host root or the driver root, as read
    here): the one its ld.so.cache names for this machine's architecture, else the first in LIBRARY_DIRS."""
    from devinject.core.errors import LdCacheError
    from devinject.discovery.libraries import locate_libraries, native_arch, read_ldcache

    try:
        found = locate_libraries(files, read_ldcache(files), (NVML_SONAME,), native_arch())
    except LdCacheError:
        found = []
    if found:
        return files.real(found[0].real)
    for folder in LIBRARY_DIRS:
        path = files.resolve(f"{folder}/{NVML_SONAME}")
        if files.exists(path) and not files.is_dir(path):
            return files.real(path)
    return None


def warn_once(message: str) -> None:
    """NVML's absence is said once per reason (the agent rescans often), then only at debug level."""
    if message in _warned:
        log.debug("%s", message)
        return
    _warned.add(message)
    log.warning("%s", message)


def probe_command(library: str) -> list[str]:
    """The child that asks NVML: this interpreter, no user site or PYTHON* variables, the probe module."""
    return [sys.executable, "-I", "-m", "devinject.discovery.nvmlprobe", library]


def _stop(child: subprocess.Popen[bytes]) -> None:
    """Kill the child and reap it if it dies at once; one stuck in the kernel (a wedged GPU) is left to the
    Popen's own reaping, never waited for."""
    child.kill()
    try:
        child.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        log.debug("NVML probe %d did not die at once; not waiting for it", child.pid)


def read_nvml(library: str, timeout: float = NVML_TIMEOUT) -> NvmlFacts | None:
    """Ask the NVML at `library` in a child with a hard deadline; None (one warning) when it fails or hangs."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    try:
        child = subprocess.Popen(probe_command(library), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env=env, close_fds=True)
    except OSError as err:
        warn_once(f"NVML not asked: cannot start its probe: {err}")
        return None
    assert child.stdout is not None
    deadline = time.monotonic() + timeout  # one deadline for the answer and the exit
    try:
        answer = read_to_eof(child.stdout.fileno(), timeout, ANSWER_LIMIT)
    except TimeoutError:
        _stop(child)
        warn_once(f"NVML ({library}) did not answer within {timeout:g}s; GPUs are described from sysfs only")
        return None
    except TooLarge:
        _stop(child)
        warn_once(f"NVML ({library}) answered more than {ANSWER_LIMIT} bytes; GPUs are described from sysfs only")
        return None
    finally:
        child.stdout.close()
    try:
        status = child.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:  # closed its output, then hung
        _stop(child)
        status = -1
    try:
        facts = parse_answer(answer) if status == 0 else None
    except NvmlAnswerError as err:
        warn_once(f"NVML ({library}): its probe's answer: {err}; GPUs are described from sysfs only")
        return None
    if facts is None:
        reason = answer.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {status}"]
        warn_once(f"NVML ({library}) unavailable: {reason[0][:300]}; GPUs are described from sysfs only")
    return facts


def node_facts(files: Host, timeout: float = NVML_TIMEOUT) -> NvmlFacts:
    """The NVML facts of the node whose driver files are under `files`; NO_FACTS (one warning) without them."""
    library = nvml_library(files)
    if library is None:
        warn_once(f"no {NVML_SONAME} under {files.root}: GPUs are described from sysfs only")
        return NO_FACTS
    return read_nvml(library, timeout) or NO_FACTS
