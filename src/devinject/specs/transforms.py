"""The transforms of the spec pipeline: each takes a spec (or a device's edits, or the devices found) and
gives it back changed in one respect, as NVIDIA's toolkit keeps them (`pkg/nvcdi/transform`).

`spec_transforms` is the order a kind's spec goes through them: host paths rerooted for the spec's reader,
the profile's mount options, mounts a mounted directory already brings left out, mounts in order, then the
lowest CDI version the content needs. A new profile key that changes what the discoverers found is one
transform here, and one line in `spec_transforms`.
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath
from collections.abc import Callable
from dataclasses import replace

from devinject.cdi.cdiversion import required_version, version_key
from devinject.cdi.model import ContainerEdits, DeviceNode, Mount, Spec
from devinject.core.errors import SpecError
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.discovery.nvml import GpuFacts, NvmlFacts
from devinject.discovery.profiles import Profile
from devinject.specs.options import GenerateOptions

log = logging.getLogger(__name__)

Transform = Callable[[Spec], Spec]


def each_edits(spec: Spec, change: Callable[[ContainerEdits], ContainerEdits]) -> Spec:
    """`spec` with `change` applied to its own edits and to every device's."""
    return spec._replace(edits=change(spec.edits),
                         devices=tuple(d._replace(edits=change(d.edits)) for d in spec.devices))


def transformed(spec: Spec, transforms: tuple[Transform, ...]) -> Spec:
    for transform in transforms:
        spec = transform(spec)
    return spec


class Rerooter:
    """Host paths as the runtime that reads the spec will open them.

    Without a target root, host paths carry the read root's prefix (the real file on this machine: a fixture
    host, a driver root). With one (a node agent in a pod reads the host at /host, the host's runtime sees
    it at /), they are the host's own path under the target root."""

    def __init__(self, host: Host, target_root: str | None = None) -> None:
        self.host = host
        self.target_root = target_root
        self.identity = (host.root if target_root is None else target_root) == "/"

    def host_path(self, path: str) -> str:
        if self.identity:
            return path
        if self.target_root is None:
            return self.host.real(path)
        return posixpath.join(self.target_root, path.lstrip("/"))

    def node(self, node: DeviceNode) -> DeviceNode:
        if self.identity:
            return node
        return node._replace(host_path=self.host_path(node.path))

    def mount(self, mount: Mount) -> Mount:
        if self.identity:
            return mount
        return mount._replace(host_path=self.host_path(mount.host_path))

    def __call__(self, spec: Spec) -> Spec:
        """The spec's device nodes (by their container path, which is the host's) and mounts rerooted."""
        if self.identity:
            return spec
        return each_edits(spec, lambda e: e._replace(device_nodes=tuple(self.node(n) for n in e.device_nodes),
                                                     mounts=tuple(self.mount(m) for m in e.mounts)))


def with_mount_options(profile: Profile) -> Transform:
    """The profile's `mount-options` for each mount's container path, when one matches (first wins)."""

    def options_of(mount: Mount) -> Mount:
        for pattern, options in profile.mount_options:
            if fnmatch.fnmatchcase(mount.container_path, pattern):
                return Mount(mount.host_path, mount.container_path, options, mount.type)
        return mount

    if not profile.mount_options:
        return lambda spec: spec
    return lambda spec: each_edits(spec, lambda e: e._replace(mounts=tuple(options_of(m) for m in e.mounts)))


def without_nested_mounts(spec: Spec) -> Spec:
    """Drop a mount that a mounted parent directory already brings along (same file on both sides)."""

    def kept(mounts: tuple[Mount, ...]) -> tuple[Mount, ...]:
        def covered(m: Mount) -> bool:
            return any(
                other is not m
                and m.container_path.startswith(other.container_path + "/")
                and m.host_path == other.host_path + m.container_path[len(other.container_path):]
                for other in mounts
            )

        return tuple(m for m in mounts if not covered(m))

    return each_edits(spec, lambda e: e._replace(mounts=kept(e.mounts)))


def sorted_mounts(spec: Spec) -> Spec:
    """Mounts by depth, then path: a directory's mount before what is mounted inside it."""
    return each_edits(spec, lambda e: e._replace(
        mounts=tuple(sorted(e.mounts, key=lambda m: (m.container_path.count("/"), m.container_path)))))


def versioned(spec: Spec, opts: GenerateOptions) -> Spec:
    """`spec` at the lowest CDI version its content needs; an error when that is above the cap."""
    needed = required_version(spec)
    if version_key(needed) > version_key(opts.version_cap):
        raise SpecError(f"{spec.kind}: content needs CDI {needed}, above the --cdi-version cap {opts.version_cap}")
    return spec._replace(cdi_version=needed)


def spec_transforms(host: Host, profile: Profile, opts: GenerateOptions) -> tuple[Transform, ...]:
    """What a kind's spec goes through, in order, once its devices and common edits are discovered."""
    return (Rerooter(host, opts.target_root), with_mount_options(profile), without_nested_mounts, sorted_mounts,
            lambda spec: versioned(spec, opts))


def with_groups(edits: ContainerEdits, opts: GenerateOptions, what: str | None) -> ContainerEdits:
    """Nodes only their group may open (a DRM render node, 0660 root:render) need the container's process in
    that group to be usable by a non-root user: `additionalGids` (CDI 0.7.0) when the cap allows it; else the
    log says what to add (`--group-add`), and the spec stays readable by older runtimes."""
    gids = sorted({n.gid for n in edits.device_nodes
                   if n.gid and n.file_mode is not None and n.file_mode & 0o006 != 0o006})
    if not gids:
        return edits
    if version_key(opts.version_cap) >= version_key("0.7.0"):
        return edits._replace(additional_gids=tuple(gids))
    if what is not None:
        log.warning("%s: device nodes open to group %s only: a non-root container user needs it (--group-add %s); "
                    "additionalGids needs CDI 0.7.0, above the --cdi-version cap %s", what,
                    ",".join(map(str, gids)), ",".join(map(str, gids)), opts.version_cap)
    return edits


def enrich_uuids(found: list[FoundDevice], facts: NvmlFacts) -> list[FoundDevice]:
    """The devices found, with the UUIDs procfs does not give from NVML's facts (profiles with `uuid.nvml`): a
    GPU's, and its MIG devices'."""
    out = []
    for item in found:
        gpu = facts.gpu(item.address) if item.profile.uuid_nvml else None
        if gpu is not None:
            item = replace(item, uuid=item.uuid or gpu.uuid, partitions=tuple(
                replace(p, uuid=p.uuid or _mig_uuid(gpu, p.gpu_instance, p.compute_instance))
                for p in item.partitions))
        out.append(item)
    return out


def _mig_uuid(gpu: GpuFacts, gpu_instance: int, compute_instance: int) -> str | None:
    mig = gpu.mig(gpu_instance, compute_instance)
    return mig.uuid if mig else None
