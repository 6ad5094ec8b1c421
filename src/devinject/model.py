"""The CDI data model: immutable values shared by `generate` and `hook`. No I/O here.

NamedTuples rather than dataclasses: `dataclasses` costs the hook ~6 ms of imports on every container start.

Every field is one that CDI 0.5.0 defines; newer fields are never modelled, so they can never be emitted.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple, TypeVar

    T = TypeVar("T")
else:
    from devinject.records import NamedTuple

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


class ContainerEdits(NamedTuple):
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks)

    def merge(self, other: ContainerEdits) -> ContainerEdits:
        """Concatenate, dropping exact duplicates (the `all` device merges many devices' edits)."""
        return ContainerEdits(
            env=_unique(self.env + other.env),
            device_nodes=_unique(self.device_nodes + other.device_nodes),
            mounts=_unique(self.mounts + other.mounts),
            hooks=_unique(self.hooks + other.hooks),
        )


class Device(NamedTuple):
    name: str
    edits: ContainerEdits


class Spec(NamedTuple):
    kind: str
    devices: tuple[Device, ...]
    edits: ContainerEdits = ContainerEdits()
    cdi_version: str = "0.5.0"

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
