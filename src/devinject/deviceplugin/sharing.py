"""Time-slicing and MPS through the device plugin, in the shape NVIDIA's device plugin reads
(`sharing.timeSlicing`, `sharing.mps`), so an admin's config carries over: each device of a time-sliced
resource is offered as `replicas` devices with IDs `<device ID>::<k>` (k = 0 .. replicas-1: stable across
restarts, and they name the device they share), under the resource's own name or a new one (`rename`, or
`<resource>.shared` by `renameByDefault`) so that pods choose. An MPS resource is replicated the same way, over
whole GPUs only, each replica's client served by the replica's own MPS control daemon (agent/mps.py; the plugin
runs one per replica while it serves the resource) and given one replica each (NVIDIA's MPS implies
failRequestsGreaterThanOne). Plain data and pure functions; the differences from NVIDIA's plugin are in
docs/sharing.md."""

from __future__ import annotations

from dataclasses import dataclass, replace

from devinject.core.errors import DevinjectError
from devinject.deviceplugin.allocation import AllocationError, PluginDevice

REPLICA_SEPARATOR = "::"
MAX_REPLICAS = 1024  # far beyond what time-slicing serves well; a typo (40000) is refused, not offered
SHARED_SUFFIX = ".shared"


class SharingConfigError(DevinjectError):
    """A `sharing:` section that cannot be used: one line naming the file and the field."""


@dataclass(frozen=True, slots=True)
class TimeSliced:
    name: str  # the resource (or kind) the config names, e.g. nvidia.com/gpu
    replicas: int
    rename: str = ""  # the resource it is served as instead; "" keeps its name
    mps: bool = False  # shared through MPS (sharing.mps) rather than time-sliced


@dataclass(frozen=True, slots=True)
class SharingConfig:
    resources: tuple[TimeSliced, ...] = ()
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False

    def time_sliced(self, resource: str, kind: str) -> TimeSliced | None:
        """The entry for a resource served as `resource` (its kind `kind`), if it is time-sliced."""
        for entry in self.resources:
            if entry.name in (resource, kind):
                return entry
        return None

    def served_as(self, resource: str, kind: str) -> str:
        """The resource name the kubelet sees: renamed when time-sliced and asked to."""
        entry = self.time_sliced(resource, kind)
        if entry is None:
            return resource
        if entry.rename:
            return entry.rename
        return resource + SHARED_SUFFIX if self.rename_by_default else resource


def _resource_name_problem(name: str) -> str | None:
    """A kubelet extended resource name: `domain/name`, a DNS subdomain and a name of [A-Za-z0-9._-]."""
    domain, sep, base = name.partition("/")
    if not sep or not domain or not base or "/" in base:
        return "expected a resource name domain/name (e.g. nvidia.com/gpu)"
    if not all(c.isalnum() or c in ".-" for c in domain) or not all(c.isalnum() or c in "._-" for c in base):
        return "expected a resource name domain/name of letters, digits, '.', '-' and '_'"
    if len(name) > 63 + 253:
        return "too long for a resource name"
    return None


def _bool(source: str, field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SharingConfigError(f"{source}: {field}: expected true or false, got {value!r}")
    return value


def _mapping(source: str, field: str, value: object, allowed: tuple[str, ...]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise SharingConfigError(f"{source}: {field}: expected a mapping, got {value!r}")
    for key in value:
        if key not in allowed:
            raise SharingConfigError(f"{source}: {field}.{key}: unknown field (known: {', '.join(allowed)})")
    return {str(k): v for k, v in value.items()}


def parse_sharing(value: object, source: str) -> SharingConfig:
    """The `sharing:` section of the device plugin's config file `source` (NVIDIA's shape): `timeSlicing` or
    `mps`, one of them (as NVIDIA's plugin, one strategy per config)."""
    section = _mapping(source, "sharing", value, ("timeSlicing", "mps"))
    given = [k for k in ("timeSlicing", "mps") if section.get(k) is not None]
    if len(given) > 1:
        raise SharingConfigError(f"{source}: sharing: timeSlicing and mps cannot both be set (one strategy per "
                                 "config)")
    if not given:
        return SharingConfig()
    mps = given[0] == "mps"
    field = f"sharing.{given[0]}"
    slicing = _mapping(source, field, section[given[0]],
                       ("renameByDefault", "failRequestsGreaterThanOne", "resources"))
    rename_by_default = _bool(source, f"{field}.renameByDefault", slicing.get("renameByDefault", False))
    fail_more = _bool(source, f"{field}.failRequestsGreaterThanOne", slicing.get("failRequestsGreaterThanOne", False))
    fail_more = fail_more or mps  # an MPS client is one process on one replica's daemon: one replica a request
    listed = slicing.get("resources", [])
    if not isinstance(listed, list):
        raise SharingConfigError(f"{source}: {field}.resources: expected a list, got {listed!r}")
    resources: list[TimeSliced] = []
    served: dict[str, str] = {}  # served name -> the field that serves it
    for index, item in enumerate(listed):
        at = f"{field}.resources[{index}]"
        resource = _shared_resource(source, at, item, resources, mps)
        resolved = resource.rename or (resource.name + SHARED_SUFFIX if rename_by_default else resource.name)
        if resolved in served:
            raise SharingConfigError(f"{source}: {at}: served as {resolved}, as {served[resolved]} is")
        served[resolved] = at
        resources.append(resource)
    return SharingConfig(tuple(resources), rename_by_default, fail_more)


def _shared_resource(source: str, at: str, item: object, earlier: list[TimeSliced], mps: bool) -> TimeSliced:
    """One entry of `resources` (at `at`): a resource name not listed before, its replicas, `devices: all`, and
    its rename (a bare name takes the resource's domain)."""
    entry = _mapping(source, at, item, ("name", "replicas", "rename", "devices"))
    name = entry.get("name")
    if not isinstance(name, str) or _resource_name_problem(name):
        problem = _resource_name_problem(name) if isinstance(name, str) else "expected a resource name"
        raise SharingConfigError(f"{source}: {at}.name: {problem}, got {name!r}")
    if any(r.name == name for r in earlier):
        raise SharingConfigError(f"{source}: {at}.name: {name} is listed twice")
    replicas = entry.get("replicas")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise SharingConfigError(f"{source}: {at}.replicas: expected a whole number from 1 to {MAX_REPLICAS}, "
                                 f"got {replicas!r}")
    devices = entry.get("devices", "all")
    if devices != "all":
        raise SharingConfigError(f"{source}: {at}.devices: only 'all' is supported (every device of the "
                                 f"resource is time-sliced), got {devices!r}")
    rename = entry.get("rename", "")
    if not isinstance(rename, str):
        raise SharingConfigError(f"{source}: {at}.rename: expected a resource name, got {rename!r}")
    if rename and "/" not in rename:
        rename = f"{name.partition('/')[0]}/{rename}"  # a bare name takes the resource's domain
    if rename and _resource_name_problem(rename):
        raise SharingConfigError(f"{source}: {at}.rename: {_resource_name_problem(rename)}, got {rename!r}")
    return TimeSliced(name, replicas, rename, mps)


def replica_id(device_id: str, k: int) -> str:
    return f"{device_id}{REPLICA_SEPARATOR}{k}"


def replicated(devices: dict[str, PluginDevice], replicas: int) -> dict[str, PluginDevice]:
    """Each device as `replicas` devices `<ID>::<k>`, each naming its device (`parent`) and the one CDI device;
    a replica's health is its device's, so a take-out takes all of them out together."""
    return {replica_id(d.id, k): replace(d, id=replica_id(d.id, k), parent=d.id, replicas=replicas)
            for d in devices.values() for k in range(replicas)}


def check_replicas(devices: dict[str, PluginDevice], ids: list[str], *, fail_greater_than_one: bool) -> None:
    """One container's request of a time-sliced resource: at most one replica when failRequestsGreaterThanOne,
    else replicas of different devices (two replicas of one GPU are no more GPU)."""
    replicas = [i for i in ids if i in devices and devices[i].parent]
    if len(replicas) > 1 and fail_greater_than_one:
        raise AllocationError(f"{len(replicas)} replicas asked for in one request; failRequestsGreaterThanOne "
                              "allows one replica of a time-sliced device")
    seen: dict[str, str] = {}
    for device_id in replicas:
        parent = devices[device_id].parent
        if parent in seen:
            raise AllocationError(f"replicas {seen[parent]} and {device_id} are one device ({parent}): a request "
                                  "gets replicas of different devices")
        seen[parent] = device_id


def preferred_replicas(devices: dict[str, PluginDevice], available: list[str], must_include: list[str],
                       size: int, avoid: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """`size` replicas of different devices, the least-shared devices first (fewest of their replicas given
    out: the kubelet's available list says which are free), ties by device ID; the lowest free replica of
    each. `must_include` first. Devices in `avoid` (held through another path) only when nothing else is left.
    Fewer than `size` distinct devices: the rest are filled from what is left (Allocate then refuses)."""
    free: dict[str, list[str]] = {}
    for device_id in available:
        device = devices.get(device_id)
        if device is not None:
            free.setdefault(device.parent or device.id, []).append(device_id)
    chosen = [i for i in must_include if i in available]
    used = {devices[i].parent or i for i in chosen if i in devices}

    def load(parent: str) -> tuple[bool, int, str]:
        total = next((devices[i].replicas for i in free[parent]), 1)
        return (parent in avoid, total - len(free[parent]), parent)

    for parent in sorted(free, key=load):
        if len(chosen) >= size:
            break
        if parent in used:
            continue
        chosen.append(min(free[parent], key=lambda i: (len(i), i)))
        used.add(parent)
    rest = [i for i in available if i not in chosen]
    return (chosen + rest)[:size]
