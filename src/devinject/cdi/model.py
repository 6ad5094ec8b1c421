"""The CDI data model: immutable values shared by `generate` and `hook`. No I/O here.

NamedTuples rather than dataclasses: `dataclasses` costs the hook ~6 ms of imports on every container start.

Every field CDI defines up to 1.1.0 is modelled, so any released spec is read (and cached by the hook)
without loss. `generate` fills only what its `--cdi-version` cap allows, and writes the lowest version the
content needs (spec.required_version).
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple, TypeVar

    T = TypeVar("T")
else:
    from devinject.core.records import NamedTuple

# Options for driver files bind-mounted into a container: never writable, never a way to smuggle in
# setuid binaries or device nodes.
READ_ONLY_BIND = ("ro", "nosuid", "nodev", "bind")


class DeviceNode(NamedTuple):
    path: str
    host_path: str | None = None
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str | None = None
    uid: int | None = None
    gid: int | None = None


class Mount(NamedTuple):
    host_path: str
    container_path: str
    options: tuple[str, ...] = READ_ONLY_BIND
    type: str | None = None


class Hook(NamedTuple):
    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


class NetDevice(NamedTuple):
    """CDI 1.1.0: a host network interface moved into the container's network namespace as `name`."""
    host_interface_name: str
    name: str


class IntelRdt(NamedTuple):
    """CDI 0.7.0 (enable_cmt/enable_mbm until 1.0.0; schemata and enable_monitoring from 1.1.0)."""
    clos_id: str | None = None
    l3_cache_schema: str | None = None
    mem_bw_schema: str | None = None
    enable_cmt: bool | None = None
    enable_mbm: bool | None = None
    schemata: tuple[str, ...] | None = None
    enable_monitoring: bool | None = None


class ContainerEdits(NamedTuple):
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    net_devices: tuple[NetDevice, ...] = ()  # 1.1.0
    additional_gids: tuple[int, ...] = ()  # 0.7.0
    intel_rdt: IntelRdt | None = None  # 0.7.0

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks or self.net_devices
                    or self.additional_gids or self.intel_rdt is not None)

    def merge(self, other: ContainerEdits) -> ContainerEdits:
        """Concatenate, dropping exact duplicates (the `all` device merges many devices' edits); a later
        intelRdt replaces an earlier one, as CDI applies it."""
        return ContainerEdits(
            env=_unique(self.env + other.env),
            device_nodes=_unique(self.device_nodes + other.device_nodes),
            mounts=_unique(self.mounts + other.mounts),
            hooks=_unique(self.hooks + other.hooks),
            net_devices=_unique(self.net_devices + other.net_devices),
            additional_gids=_unique(self.additional_gids + other.additional_gids),
            intel_rdt=other.intel_rdt if other.intel_rdt is not None else self.intel_rdt,
        )


class Device(NamedTuple):
    name: str
    edits: ContainerEdits
    annotations: tuple[tuple[str, str], ...] = ()  # 0.6.0


class Spec(NamedTuple):
    kind: str
    devices: tuple[Device, ...]
    edits: ContainerEdits = ContainerEdits()
    cdi_version: str = "0.5.0"
    annotations: tuple[tuple[str, str], ...] = ()  # 0.6.0

    @property
    def vendor(self) -> str:
        return self.kind.partition("/")[0]

    @property
    def device_class(self) -> str:
        return self.kind.partition("/")[2]

    def device(self, name: str) -> Device | None:
        for device in self.devices:
            if device.name == name:
                return device
        return None


def _unique(items: tuple[T, ...]) -> tuple[T, ...]:
    return tuple(dict.fromkeys(items))
