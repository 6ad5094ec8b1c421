"""A claim's opaque configuration for this driver: `GpuConfig` in the driver's own API group, NVIDIA's DRA
driver's `GpuConfig` field for field (its `resource.nvidia.com/v1beta1` translates by changing `apiVersion`):

    apiVersion: dra.devinject.io/v1alpha1
    kind: GpuConfig
    sharing:
      strategy: TimeSlicing | MPS
      timeSlicingConfig: {interval: Default | Short | Medium | Long}
      mpsConfig: {defaultActiveThreadPercentage: 1..100, defaultPinnedDeviceMemoryLimit: 10Gi,
                  defaultPerDevicePinnedMemoryLimit: {"0": 4Gi}}

Everything in it is the pod user's and hostile: each field is checked, and a bad one is one line naming the
config and the field (it reaches the pod's events; the claim is not prepared). Pure functions; what the
differences from NVIDIA's are: docs/sharing.md."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from devinject.core.asciitext import is_digits
from devinject.core.errors import DevinjectError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from devinject.nodestate.claimcheckpoints import JsonObject

API_VERSION = "v1alpha1"
KIND = "GpuConfig"
TIME_SLICING, MPS = "TimeSlicing", "MPS"
INTERVALS = ("Default", "Short", "Medium", "Long")
NVIDIA_GROUP = "resource.nvidia.com"
MAX_DEVICE_LIMITS = 64  # more keys than devices on any node: refused, not iterated
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")  # fullmatch: no "4Gi\n"
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


class GpuConfigError(DevinjectError):
    """An opaque config this driver cannot apply: one line naming where it is and the field."""


@dataclass(frozen=True, slots=True)
class MpsSettings:
    active_thread_percentage: int | None = None
    pinned_memory_limit_mb: int | None = None  # for every device of the request
    per_device_limit_mb: dict[str, int] = field(default_factory=dict)  # device index (in the claim) -> MB


@dataclass(frozen=True, slots=True)
class GpuSharing:
    """How a claim's request shares its GPUs: exclusive (no config), TimeSlicing or MPS."""

    strategy: str = "Exclusive"
    interval: str = "Default"
    mps: MpsSettings | None = None

    @property
    def mode(self) -> str:
        """The ledger's word: exclusive, time-slicing, mps."""
        return {TIME_SLICING: "time-slicing", MPS: "mps"}.get(self.strategy, "exclusive")

    def to_json(self) -> JsonObject:
        out: JsonObject = {"strategy": self.strategy}
        if self.strategy == TIME_SLICING:
            out["interval"] = self.interval
        if self.mps is not None:
            out["mps"] = {"activeThreadPercentage": self.mps.active_thread_percentage,
                          "pinnedMemoryLimitMB": self.mps.pinned_memory_limit_mb,
                          "perDevicePinnedMemoryLimitMB": {k: v for k, v in self.mps.per_device_limit_mb.items()}}
        return out


EXCLUSIVE = GpuSharing()


def _mapping(where: str, name: str, value: object, allowed: tuple[str, ...]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise GpuConfigError(f"{where}: {name}: expected an object, got {_shown(value)}")
    for key in value:
        if key not in allowed:
            raise GpuConfigError(f"{where}: {name}.{_shown(key)}: unknown field (known: {', '.join(allowed)})")
    return value


def _shown(value: object) -> str:
    """A hostile value, shown short and on one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def megabytes(where: str, name: str, value: object) -> int:
    """A Kubernetes quantity (10Gi, 512Mi, 4G, 1073741824) in whole MiB, at least 1 (as NVIDIA's driver)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise GpuConfigError(f"{where}: {name}: expected a quantity such as 4Gi, got {_shown(value)}")
    match = _QUANTITY.fullmatch(str(value)) if len(str(value)) <= 32 else None
    if match is None:
        raise GpuConfigError(f"{where}: {name}: expected a quantity such as 4Gi, got {_shown(value)}")
    number, unit = match.groups()
    whole, _, fraction = number.partition(".")
    scale = _UNITS[unit]
    size = int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)
    mb = size // 2**20
    if mb < 1:
        raise GpuConfigError(f"{where}: {name}: {value} is less than 1Mi")
    return mb


def parse_gpu_config(parameters: object, where: str, group: str) -> GpuSharing:
    """A `GpuConfig` of API group `group` (the driver's name): its sharing, or GpuConfigError."""
    top = _mapping(where, "parameters", parameters, ("apiVersion", "kind", "sharing"))
    wanted = f"{group}/{API_VERSION}"
    version = top.get("apiVersion")
    if version != wanted:
        hint = (f" (NVIDIA's {NVIDIA_GROUP} GpuConfig translates by changing apiVersion only)"
                if isinstance(version, str) and version.startswith(NVIDIA_GROUP + "/") else "")
        raise GpuConfigError(f"{where}: apiVersion: expected {wanted}, got {_shown(version)}{hint}")
    if top.get("kind") != KIND:
        raise GpuConfigError(f"{where}: kind: expected {KIND}, got {_shown(top.get('kind'))}")
    if "sharing" not in top or top["sharing"] is None:
        return EXCLUSIVE
    sharing = _mapping(where, "sharing", top["sharing"], ("strategy", "timeSlicingConfig", "mpsConfig"))
    strategy = sharing.get("strategy")
    if strategy not in (TIME_SLICING, MPS):
        raise GpuConfigError(f"{where}: sharing.strategy: expected {TIME_SLICING} or {MPS}, got {_shown(strategy)}")
    if strategy == TIME_SLICING:
        return _time_slicing(where, sharing)
    return _mps(where, sharing)


def _time_slicing(where: str, sharing: Mapping[str, object]) -> GpuSharing:
    """sharing with the time-slicing strategy: its timeSlicingConfig's interval."""
    if sharing.get("mpsConfig") is not None:
        raise GpuConfigError(f"{where}: sharing.mpsConfig: cannot be used with the {TIME_SLICING} strategy")
    config = sharing.get("timeSlicingConfig") or {}
    slicing = _mapping(where, "sharing.timeSlicingConfig", config, ("interval",))
    interval = slicing.get("interval", "Default")
    if interval not in INTERVALS:
        raise GpuConfigError(f"{where}: sharing.timeSlicingConfig.interval: expected one of "
                             f"{', '.join(INTERVALS)}, got {_shown(interval)}")
    return GpuSharing(TIME_SLICING, str(interval))


def _mps(where: str, sharing: Mapping[str, object]) -> GpuSharing:
    """sharing with the MPS strategy: its mpsConfig's thread percentage and pinned memory limits."""
    if sharing.get("timeSlicingConfig") is not None:
        raise GpuConfigError(f"{where}: sharing.timeSlicingConfig: cannot be used with the {MPS} strategy")
    at = "sharing.mpsConfig"
    mps = _mapping(where, at, sharing.get("mpsConfig") or {},
                   ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                    "defaultPerDevicePinnedMemoryLimit"))
    percentage = mps.get("defaultActiveThreadPercentage")
    if percentage is not None and (isinstance(percentage, bool) or not isinstance(percentage, int)
                                   or not 1 <= percentage <= 100):
        raise GpuConfigError(f"{where}: {at}.defaultActiveThreadPercentage: expected a whole number from 1 to "
                             f"100, got {_shown(percentage)}")
    limit = mps.get("defaultPinnedDeviceMemoryLimit")
    limit_mb = None if limit is None else megabytes(where, f"{at}.defaultPinnedDeviceMemoryLimit", limit)
    return GpuSharing(MPS, mps=MpsSettings(percentage, limit_mb, _per_device_limits(where, at, mps)))


def _per_device_limits(where: str, at: str, mps: Mapping[str, object]) -> dict[str, int]:
    """defaultPerDevicePinnedMemoryLimit: MB by the device's index in the claim."""
    per_device: dict[str, int] = {}
    listed = mps.get("defaultPerDevicePinnedMemoryLimit") or {}
    if not isinstance(listed, dict) or len(listed) > MAX_DEVICE_LIMITS:
        raise GpuConfigError(f"{where}: {at}.defaultPerDevicePinnedMemoryLimit: expected an object of device "
                             f"index to quantity (at most {MAX_DEVICE_LIMITS})")
    for key, value in listed.items():
        if not (isinstance(key, str) and is_digits(key) and len(key) <= 3):
            raise GpuConfigError(f"{where}: {at}.defaultPerDevicePinnedMemoryLimit.{_shown(key)}: expected a "
                                 "device index in the claim (0, 1, ...)")
        per_device[str(int(key))] = megabytes(where, f"{at}.defaultPerDevicePinnedMemoryLimit.{key}", value)
    return per_device


def request_sharing(configs: object, driver: str, where: str, requests: list[str]) -> dict[str, GpuSharing]:
    """Each request's sharing from `status.allocation.devices.config[]`: the entries of this driver, in order
    (the class's before the claim's, as the API server lists them), the last naming a request winning; an
    entry without `requests` applies to all. A request no config names stays exclusive."""
    out = dict.fromkeys(requests, EXCLUSIVE)
    for index, config in enumerate(configs if isinstance(configs, list) else []):
        opaque = config.get("opaque") if isinstance(config, dict) else None
        if not (isinstance(opaque, dict) and opaque.get("driver") == driver):
            continue
        at = f"{where}.config[{index}].opaque"
        sharing = parse_gpu_config(opaque.get("parameters"), at, driver)
        named = config.get("requests") or []
        if not isinstance(named, list) or not all(isinstance(r, str) for r in named):
            raise GpuConfigError(f"{where}.config[{index}].requests: expected a list of request names")
        for request in requests:
            if not named or request in named or request.partition("/")[0] in named:
                out[request] = sharing
    return out
