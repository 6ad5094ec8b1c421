"""`generate`: discovered devices -> one CDI spec per kind, validated, lowest version that fits.

The pipeline: select the profiles (`kind_profiles`) -> discover their devices (`served_devices`, UUIDs
enriched) -> each kind's spec-level edits (specs/discoverers.py) and its devices' edits (here) -> the spec
through its transforms (specs/transforms.py: rerooting, mount options, order, CDI version) -> render and
write (specs/output.py). `generate`, `watch`, `list` and the DRA driver's claims all go through these steps,
so they cannot produce different specs.
"""

from __future__ import annotations

import posixpath

from devinject.cdi.identity import device_key, path_identity
from devinject.cdi.model import ContainerEdits, Device, DeviceNode, Spec
from devinject.core.errors import ConfigError
from devinject.discovery.channels import profile_channels
from devinject.discovery.discover import FoundDevice, HostView, discover
from devinject.discovery.host import Host
from devinject.discovery.libraries import LDCACHE_PATH, read_ldcache
from devinject.discovery.node import Node, device_names
from devinject.discovery.profiles import Profile
from devinject.specs.discoverers import DriverEdits, FileSources, common_edits, driver_edits, driver_version, with_hook
from devinject.specs.hooks import (
    HOOK_ENV,
    HOOK_TIMEOUT,
    HookCommand,
    default_hook_path,
    drm_by_path_links,
    gpu_nodes,
    hook_command,
)
from devinject.specs.options import STRATEGIES, GenerateOptions
from devinject.specs.output import render, spec_filename, write_specs
from devinject.specs.transforms import Transform, enrich_uuids, spec_transforms, transformed, versioned, with_groups

__all__ = [  # the pipeline's way in for generate, watch, the DRA driver's claims, doctor and nfd
    "HOOK_ENV", "HOOK_TIMEOUT", "STRATEGIES", "GenerateOptions", "build_specs", "default_hook_path",
    "driver_version", "generate_specs", "hook_command", "kind_profiles", "render", "served_devices",
    "spec_filename", "versioned", "write_specs",
]


def kind_profiles(profiles: list[Profile], opts: GenerateOptions) -> list[Profile]:
    """`profiles`, or those of --kind (each kind asked for must be offered by one)."""
    known = {p.kind for p in profiles}
    for kind in opts.kinds:
        if kind not in known:
            raise ConfigError(f"--kind: no profile offers {kind!r} (known: {', '.join(sorted(known))})")
    return [p for p in profiles if p.kind in opts.kinds] if opts.kinds else profiles


def served_devices(node: Node, opts: GenerateOptions) -> tuple[list[Profile], list[FoundDevice]]:
    """The device families to serve (the node's profiles, or those of --kind) and their devices, UUIDs filled
    from NVML where that is asked for: `generate` and `watch` both take them from here."""
    profiles = kind_profiles(node.profiles, opts)
    # a --kind subset is discovered on its own: a function whose first profile is left out may match another
    found = node.devices() if profiles == node.profiles else discover(node.host, profiles, view=node.view)
    wanted = [f for f in found if f.profile.uuid_nvml and (not f.uuid or any(not p.uuid for p in f.partitions))]
    if not wanted:
        return profiles, found
    return profiles, enrich_uuids(found, node.nvml_facts(opts.nvml, opts.driver_root))


def _device_edits(item: FoundDevice, opts: GenerateOptions) -> list[tuple[list[str], ContainerEdits]]:
    """A device's edits (as the host names its nodes) with their names: a device with partitions (MIG
    devices) is offered as its partitions only, each by its name and, with the uuid strategy, its UUID; else
    the device by each of its names, with the groups its nodes need (its DRM by-path links are the spec-level
    hook's: `_device_links`)."""
    if item.partitions:
        out = []
        for partition in item.partitions:
            names = [partition.name]
            if partition.uuid and (not opts.strategies or "uuid" in opts.strategies):
                names.append(partition.uuid)  # MIG-<uuid>, as NVIDIA names it
            out.append((names, ContainerEdits(device_nodes=tuple(partition.nodes))))
        return out
    edits = with_groups(ContainerEdits(device_nodes=tuple(item.nodes)), opts, f"{item.profile.kind}={item.index}")
    return [] if edits.is_empty() else [(device_names(item, opts.strategies), edits)]


def _device_links(found: list[FoundDevice]) -> tuple[str, ...]:
    """Every device's own links (DRM by-path) for the spec-level hook, which makes those of the devices a
    container is given: one hook process per container, however many devices (partitioned ones have none)."""
    return tuple(link for item in found if not item.partitions for link in drm_by_path_links(item))


def _gpu_nodes(found: list[FoundDevice]) -> tuple[str, ...]:
    """Every device's GPU nodes for the spec-level hook, which writes the application profile of those a
    container is given (as `_device_links`: one hook process, however many devices)."""
    return tuple(dict.fromkeys(node for item in found for node in gpu_nodes(item)))


def build_spec(profile: Profile, found: list[FoundDevice], common: ContainerEdits, transforms: tuple[Transform, ...],
               opts: GenerateOptions) -> Spec | None:
    """The kind's spec: each device by its names, then `all` (every node once), through `transforms`."""
    devices: list[Device] = []
    every_node: dict[DeviceNode, None] = {}  # insertion-ordered set: `all` in one pass, not n merges
    for item in found:
        for names, edits in _device_edits(item, opts):
            every_node.update(dict.fromkeys(edits.device_nodes))
            devices.extend(Device(name, edits) for name in names)
    if not devices:
        return None
    devices.append(Device("all", with_groups(ContainerEdits(device_nodes=tuple(every_node)), opts, None)))
    return transformed(Spec(kind=profile.kind, devices=tuple(devices), edits=common), transforms)


def channel_spec(view: HostView, profile: Profile, common: ContainerEdits, transforms: tuple[Transform, ...],
                 opts: GenerateOptions) -> Spec | None:
    """A family of char-node devices (IMEX channels): device `N` for each `<directory>/<prefix>N` on the
    host, major from /proc/devices; none when the directory or the region is absent."""
    devices = [Device(c.name, ContainerEdits(device_nodes=(c.node,)))
               for c in profile_channels(view, profile) if c.key not in opts.exclude]
    if not devices:
        return None
    every = ContainerEdits(device_nodes=tuple(n for d in devices for n in d.edits.device_nodes))
    return transformed(Spec(kind=profile.kind, devices=(*devices, Device("all", every)), edits=common), transforms)


def _files_host(host: Host, opts: GenerateOptions) -> Host:
    """Where the driver's files are read: its --driver-root under the host root, else the host itself."""
    return Host(posixpath.join(host.root, opts.driver_root.strip("/"))) if opts.driver_root else host


def _wants_ldcache(profiles: list[Profile]) -> bool:
    return any(p.libraries or p.driver_libraries for p in profiles)


def file_sources(host: Host, profiles: list[Profile], opts: GenerateOptions) -> FileSources:
    """Where the kinds' files are read. With --driver-root (a driver installed in a container, GPU-operator
    style, at e.g. /run/nvidia/driver as the host names it) the driver's files are read under the host root,
    with the driver root's own paths as their container paths; the linker cache is the driver's then."""
    files = _files_host(host, opts)
    ldcache = tuple(read_ldcache(files)) if _wants_ldcache(profiles) else ()
    driver_root = "/" + opts.driver_root.strip("/") if opts.driver_root else ""
    return FileSources(host, files, ldcache, driver_root)


class EditsMemo:
    """The kinds' spec-level edits (`common_edits`: the driver's libraries, files, links and shared nodes),
    and the linker cache's entries they were found by, kept from one `build_specs` to the next, for a server
    that builds a spec per request: the DRA driver, one per claim, whose prepare read the driver's files again
    each time (~2.5 ms of its ~5, bench_dra.py).
    They are read again when the node is (another HostView: a rescan), with other options, or when the
    linker cache's file changed: a driver's install or upgrade runs ldconfig, so the next claim after it has
    the new driver's files, not the next rescan. Not thread-safe: its owner builds under its own lock."""

    def __init__(self) -> None:
        self._epoch: tuple[HostView, GenerateOptions, str | None] | None = None
        self._edits: dict[str, DriverEdits] = {}  # by profile
        self._sources: dict[bool, FileSources] = {}  # by whether the linker cache is read

    def renew(self, view: HostView, opts: GenerateOptions, ldcache: str | None) -> None:
        """Forget the edits kept unless they are of this view, these options and this linker cache."""
        epoch = self._epoch
        if epoch is None or epoch[0] is not view or epoch[1] is not opts or epoch[2] != ldcache:
            self._epoch, self._edits, self._sources = (view, opts, ldcache), {}, {}

    def file_sources(self, host: Host, profiles: list[Profile], opts: GenerateOptions) -> FileSources:
        """`file_sources`, the linker cache read once while the edits hold, not once per build."""
        key = _wants_ldcache(profiles)
        sources = self._sources.get(key)
        if sources is None:
            sources = self._sources[key] = file_sources(host, profiles, opts)
        return sources

    def common_edits(self, view: HostView, profile: Profile, sources: FileSources, command: HookCommand,
                     device_links: tuple[str, ...] = (), gpu_nodes: tuple[str, ...] = ()) -> ContainerEdits:
        """`common_edits`: the driver's files read once while the edits hold, the hook made for each claim's
        devices (their links and GPUs) from what was read."""
        found = self._edits.get(profile.name)
        if found is None:
            found = self._edits[profile.name] = driver_edits(view, profile, sources)
        return with_hook(found, command, device_links, gpu_nodes)


def linker_cache_identity(host: Host, opts: GenerateOptions) -> str | None:
    """The identity of the linker cache file the driver's libraries are found by (None when it has none)."""
    files = _files_host(host, opts)
    return path_identity(files.real(files.resolve(LDCACHE_PATH)))


def build_specs(host: Host, profiles: list[Profile], found: list[FoundDevice], opts: GenerateOptions,
                view: HostView | None = None, memo: EditsMemo | None = None) -> list[Spec]:
    """One spec per kind with devices; devices whose `kind=address` is in `opts.exclude` are left out. With
    `memo`, the kinds' spec-level edits are those it keeps, while they hold (EditsMemo)."""
    view = view or HostView(host)
    command = hook_command(opts.hook_path, target_root=opts.target_root, node_hook=opts.node_hook)
    sources_of, common_edits_of = file_sources, common_edits
    if memo is not None:
        memo.renew(view, opts, linker_cache_identity(host, opts))  # before the cache is read: a change after
        sources_of, common_edits_of = memo.file_sources, memo.common_edits  # it is seen by the next build
    sources = sources_of(host, profiles, opts)
    kept = [f for f in found if device_key(f.profile.kind, f.address) not in opts.exclude]
    by_kind: dict[str, list[FoundDevice]] = {}
    for item in kept:
        by_kind.setdefault(item.profile.kind, []).append(item)
    specs = []
    for profile in profiles:
        devices = by_kind.pop(profile.kind, [])
        if devices:
            common = common_edits_of(view, profile, sources, command, _device_links(devices), _gpu_nodes(devices))
            spec = build_spec(profile, devices, common, spec_transforms(host, profile, opts), opts)
            specs += [spec] if spec is not None else []
    for profile in profiles:
        if profile.channels is not None:
            channel = channel_spec(view, profile, common_edits_of(view, profile, sources, command),
                                   spec_transforms(host, profile, opts), opts)
            specs += [channel] if channel is not None else []
    if "gpu-nic" in opts.bundles:
        from devinject.specs.bundles import gpu_nic_specs

        specs += [versioned(bundle, opts) for bundle in gpu_nic_specs(host, kept, specs)]
    return specs


def generate_specs(opts: GenerateOptions, *, host: Host | None = None, node: Node | None = None) -> list[Spec]:
    """The specs of `node` (else of the node at opts.root with opts.profile_dirs, unchecked: the CLI checks its
    roots when it makes its node): its devices as discovered once, or those of the --kind profiles."""
    opts.check()
    node = node or Node(opts.root, target_root=opts.target_root, profile_dirs=opts.profile_dirs, check=False,
                        host=host)
    profiles, found = served_devices(node, opts)
    return build_specs(node.host, profiles, found, opts, node.view)
