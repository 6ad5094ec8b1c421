"""`generate`: discovered devices -> one CDI spec per kind, validated, lowest version that fits."""

from __future__ import annotations

import fnmatch
import logging
import os
import posixpath
import shutil
import stat
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from devinject.core.cdiversion import DEFAULT_VERSION_CAP, KNOWN_VERSIONS, required_version, version_key
from devinject.core.errors import ConfigError, DevinjectError, SpecError
from devinject.core.identity import device_key
from devinject.core.ldcache import LdCacheEntry
from devinject.core.model import ContainerEdits, Device, DeviceNode, Hook, Mount, Spec
from devinject.core.spec import dump
from devinject.discovery.channels import profile_channels
from devinject.discovery.discover import FoundDevice, HostView, discover, shared_nodes
from devinject.discovery.host import Host
from devinject.discovery.libraries import (
    DRIVER_VERSION_FIELD,
    LocatedFile,
    expand_fields,
    locate_binaries,
    locate_driver_libraries,
    locate_files,
    locate_libraries,
    native_arch,
    read_ldcache,
)
from devinject.discovery.node import Node, device_names
from devinject.discovery.procfs import parse_nvidia_version
from devinject.discovery.profiles import Profile

log = logging.getLogger(__name__)

STRATEGIES = ("index", "uuid", "pci")
HOOK_ENV = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
HOOK_TIMEOUT = 10


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    root: str = "/"
    kinds: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    version_cap: str = DEFAULT_VERSION_CAP
    hook_path: str | None = None
    profile_dirs: tuple[str, ...] = ()
    nvml: bool | None = None
    exclude: frozenset[str] = field(default_factory=frozenset)
    bundles: tuple[str, ...] = ()  # co-bound devices to add (specs.bundles): "gpu-nic"
    target_root: str | None = None  # the host as the spec's reader sees it (None: host paths keep `root`)
    driver_root: str | None = None  # where the driver's files are, as the host names it (None: the host's /)

    def check(self) -> None:
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ConfigError(f"--device-name-strategy: unknown {strategy!r} (use {', '.join(STRATEGIES)})")
        from devinject.specs.bundles import BUNDLES

        for bundle in self.bundles:
            if bundle not in BUNDLES:
                raise ConfigError(f"--bundles: unknown {bundle!r} (use {', '.join(BUNDLES)})")
        if self.version_cap not in KNOWN_VERSIONS:
            raise ConfigError(f"--cdi-version: unknown version {self.version_cap!r}")
        if not os.path.isdir(self.root):
            raise ConfigError(f"--host-root (--root): {self.root}: not a directory")
        if self.target_root is not None and not self.target_root.startswith("/"):
            raise ConfigError(f"--target-root: {self.target_root}: must be an absolute path")
        if self.driver_root is not None:
            if not self.driver_root.startswith("/"):
                raise ConfigError(f"--driver-root: {self.driver_root}: must be an absolute path (as the host names it)")
            inside = os.path.join(self.root, self.driver_root.lstrip("/"))
            if not os.path.isdir(inside):
                raise ConfigError(f"--driver-root: {self.driver_root}: not a directory under --host-root ({inside})")


def default_hook_path() -> str:
    """This devinject, by an absolute path: the program run (a relative `.venv/bin/devinject` made absolute),
    else the console script beside this interpreter, else the one on PATH; `/usr/local/bin/devinject` when
    none is found (generate then refuses it unless it exists: cli.py `_checked_hook_path`)."""
    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "devinject" and os.sep in argv0 and os.access(argv0, os.X_OK):
        return os.path.abspath(argv0)
    beside = os.path.join(os.path.dirname(sys.executable), "devinject")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("devinject")
    return os.path.abspath(found) if found else "/usr/local/bin/devinject"


def _launcher() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hook", "launcher.py")


def _is_this_installation(path: str) -> bool:
    """Whether `path` is this installation's own `devinject` console script: its `#!` names this interpreter
    and it runs devinject's entry. Read here, so only for a spec read on this machine (no --target-root)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    first, _, rest = head.partition(b"\n")
    return first == b"#!" + os.fsencode(sys.executable) and b"from devinject.entry import main" in rest


def hook_command(hook_path: str | None, *, target_root: str | None = None) -> tuple[str, tuple[str, ...]]:
    """How a spec's CDI hooks run devinject: (the hook's path, its argv before `cdi-hook`). By default, and for
    a --hook-path that is this installation's console script, this interpreter on the hook launcher with
    `-IS`, as `install-hook` writes the OCI hook: no `site` (a virtual environment's `site` and `.pth` files
    cost a container start ~30 ms per hook here, bench/bench_cdi_hooks.py) and nothing imported but the
    cdi-hook's own modules. Any other --hook-path (the node hook's launcher, a path as another host names
    it) runs as given."""
    if hook_path is None or (target_root is None and _is_this_installation(hook_path)):
        return sys.executable, (sys.executable, "-IS", _launcher())
    return hook_path, ("devinject",)


class Rerooter:
    """Host paths as the runtime that reads the spec will open them; container paths as the host names them.

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

    def mount(self, located: LocatedFile, container_path: str | None = None) -> Mount:
        return Mount(host_path=self.host_path(located.real), container_path=container_path or located.real)


def driver_version(host: Host, profile: Profile, libraries: list[LocatedFile]) -> str | None:
    if profile.driver_version_file:
        version = parse_nvidia_version(host.read_text(profile.driver_version_file) or "")
        if version:
            return version
    if profile.driver_module:
        version = host.read_attr(f"/sys/module/{profile.driver_module}/version")
        if version:
            return version
    for library in libraries:  # libcuda.so.1 -> libcuda.so.550.54.14
        base = posixpath.basename(library.real)
        _, _, suffix = base.partition(".so.")
        if suffix.count(".") >= 1 and suffix.replace(".", "").isdigit():
            return suffix
    return None


def _libraries_and_version(host: Host, files: Host, profile: Profile,
                           ldcache: list[LdCacheEntry]) -> tuple[list[LocatedFile], str | None]:
    """The profile's `libraries` and the running driver's version. A pattern with `{driver_version}`
    (`libnvidia-gpucomp.so.{driver_version}`) takes only that version's library, once the version is known
    (procfs, the module, or else the suffix of a library the other patterns found); an old driver's left
    behind is not mounted."""
    fixed = tuple(p for p in profile.libraries if DRIVER_VERSION_FIELD not in p)
    libraries = locate_libraries(files, ldcache, fixed, native_arch()) if fixed else []
    version = driver_version(host, profile, libraries)
    pinned = expand_fields(tuple(p for p in profile.libraries if p not in fixed), driver_version=version)
    if pinned:
        known = {lib.path for lib in libraries}
        libraries += [lib for lib in locate_libraries(files, ldcache, tuple(pinned), native_arch())
                      if lib.path not in known]
        libraries.sort(key=lambda lib: lib.path)
    return libraries, version


def _first_file(hosts: list[Host], candidates: tuple[str, ...]) -> tuple[Host, LocatedFile] | None:
    """The first candidate path that is a regular file (links followed inside the root), and where."""
    for where in hosts:
        for path in candidates:
            real = where.resolve(path)
            st = where.lstat(real)
            if st is not None and stat.S_ISREG(st.st_mode):
                return where, LocatedFile(path, real)
    return None


def _development_links(files: Host, libraries: list[LocatedFile], declared: tuple[tuple[str, str], ...],
                       mounted: list[LocatedFile], version: str | None) -> list[str]:
    """`libX.so -> libX.so.1` links next to mounted libraries (compilers and JITs link `-lcuda`): those the
    driver made on the host, and those the profile declares (`links`), which are made whenever their target
    is mounted (a library or another driver file: `libglxserver_nvidia.so` beside the X.Org module), in its
    directory or below it (`gbm/nvidia-drm_gbm.so`). As TARGET::LINK, the target relative to the link."""
    out: dict[str, None] = {}
    by_name: dict[str, list[LocatedFile]] = {}
    for located in [*libraries, *mounted]:
        by_name.setdefault(posixpath.basename(located.path), []).append(located)
    for link, target in declared:
        names = expand_fields((target,), driver_version=version)  # none when the version is not known
        for found in dict.fromkeys(f.path for name in names for f in by_name.get(name, [])):
            at = posixpath.join(posixpath.dirname(found), link)
            out[f"{posixpath.relpath(found, posixpath.dirname(at))}::{at}"] = None
    for lib in libraries:
        directory, name = posixpath.split(lib.path)
        stem = name.partition(".so")[0]
        dev = posixpath.join(directory, stem + ".so")
        if dev not in (lib.path, lib.real) and files.is_link(dev) and files.resolve(dev) == lib.real:
            out[f"{name}::{dev}"] = None
    return list(out)


def _link_target(library: LocatedFile) -> str:
    """Relative within one directory (as ldconfig makes SONAME links), absolute otherwise."""
    same_dir = posixpath.dirname(library.real) == posixpath.dirname(library.path)
    return posixpath.basename(library.real) if same_dir else library.real


def _cdi_hook(command: tuple[str, tuple[str, ...]], subcommand: str, *flags: tuple[str, list[str]]) -> Hook:
    """A createContainer hook running one of devinject's own `cdi-hook` subcommands (`command`: hook_command's)."""
    path, argv = command
    args = [*argv, "cdi-hook", subcommand]
    for flag, values in flags:
        for value in values:
            args += [flag, value]
    return Hook("createContainer", path, tuple(args), HOOK_ENV, HOOK_TIMEOUT)


def _library_hook(command: tuple[str, tuple[str, ...]], links: list[str], folders: list[str],
                  forward_compat: list[str]) -> tuple[Hook, ...]:
    """The spec-level hook: one process per container for the links and the linker cache together (each hook
    is an interpreter's start), the single-purpose subcommand when only one is needed, none when neither is."""
    if links and folders:
        return (_cdi_hook(command, "links-and-ldcache", ("--link", links), ("--folder", folders),
                          ("--forward-compat", forward_compat)),)
    if links:
        return (_cdi_hook(command, "create-symlinks", ("--link", links)),)
    if folders:
        return (_cdi_hook(command, "update-ldcache", ("--folder", folders), ("--forward-compat", forward_compat)),)
    return ()


def _holds_library(files: Host, directory: str) -> bool:
    """Whether a library directory of the profile's holds a shared library: one that holds none needs no
    linker cache change in the container."""
    return any(".so" in name and not files.is_dir(posixpath.join(directory, name)) for name in files.listdir(directory))


def common_edits(view: HostView, profile: Profile, rerooter: Rerooter, command: tuple[str, tuple[str, ...]],
                 ldcache: list[LdCacheEntry] | None, driver: tuple[Host, Rerooter] | None = None) -> ContainerEdits:
    """The kind's spec-level edits: shared device nodes from the host; driver files (libraries, binaries,
    firmware and other files) from `driver` (a driver root) or else the host too."""
    host = view.host
    files, files_rerooter = driver or (host, rerooter)
    libraries, version = _libraries_and_version(host, files, profile, ldcache or [])
    if profile.driver_libraries:
        known = {lib.real for lib in libraries}
        libraries += [lib for lib in locate_driver_libraries(files, ldcache or [], profile.driver_libraries,
                                                             native_arch(), version) if lib.real not in known]
        libraries.sort(key=lambda lib: lib.path)
    mounts: dict[str, Mount] = {}
    for library in libraries:
        mounts.setdefault(library.real, files_rerooter.mount(library))
    for directory in profile.library_dirs:
        if files.is_dir(directory):
            mounts.setdefault(directory, files_rerooter.mount(LocatedFile(directory, files.resolve(directory)),
                                                              directory))
    driver_files = locate_binaries(files, profile.binaries) + locate_files(files, profile.files,
                                                                           driver_version=version)
    for located in driver_files:
        mounts.setdefault(located.path, files_rerooter.mount(located, located.path))
    for config in profile.config_files:
        chosen = _first_file([files, host] if driver else [files], config.host)
        if chosen is not None:
            where, found = chosen
            mounts.setdefault(config.container, (files_rerooter if where is files else rerooter).mount(
                found, config.container))
    links = [f"{_link_target(lib)}::{lib.path}" for lib in libraries if lib.real != lib.path]
    links += _development_links(files, libraries, profile.links, driver_files, version)
    folders = sorted({posixpath.dirname(lib.real) for lib in libraries} | {
        d for d in profile.library_dirs if d in mounts and _holds_library(files, d)})
    forward_compat = []
    if profile.forward_compat and version and folders:  # e.g. CUDA's: an image's newer libcuda comes first
        compat_dir, compat_lib = profile.forward_compat
        forward_compat.append(f"{compat_dir}:{compat_lib}:{version}")
    hooks = _library_hook(command, links, folders, forward_compat)
    ordered_mounts = sorted(_without_nested([_with_options(m, profile) for m in mounts.values()]),
                            key=lambda m: (m.container_path.count("/"), m.container_path))
    return ContainerEdits(
        env=profile.env,
        device_nodes=tuple(rerooter.node(n) for n in shared_nodes(view, profile)),
        mounts=tuple(ordered_mounts),
        hooks=hooks,
    )


def _with_options(mount: Mount, profile: Profile) -> Mount:
    """The profile's `mount-options` for this container path, when one matches (first wins)."""
    for pattern, options in profile.mount_options:
        if fnmatch.fnmatchcase(mount.container_path, pattern):
            return Mount(mount.host_path, mount.container_path, options, mount.type)
    return mount


def _without_nested(mounts: list[Mount]) -> list[Mount]:
    """Drop a mount that a mounted parent directory already brings along (same file on both sides)."""

    def covered(m: Mount) -> bool:
        return any(
            other is not m
            and m.container_path.startswith(other.container_path + "/")
            and m.host_path == other.host_path + m.container_path[len(other.container_path):]
            for other in mounts
        )

    return [m for m in mounts if not covered(m)]


def build_spec(profile: Profile, found: list[FoundDevice], common: ContainerEdits, rerooter: Rerooter,
               opts: GenerateOptions) -> Spec | None:
    devices: list[Device] = []
    every_node: dict[DeviceNode, None] = {}  # insertion-ordered set: `all` in one pass, not n merges
    every_hook: dict[Hook, None] = {}
    for item in found:
        if item.partitions:  # offered as its partitions (MIG devices) only, never whole
            for partition in item.partitions:
                edits = ContainerEdits(device_nodes=tuple(rerooter.node(n) for n in partition.nodes))
                every_node.update(dict.fromkeys(edits.device_nodes))
                names = [partition.name]
                if partition.uuid and (not opts.strategies or "uuid" in opts.strategies):
                    names.append(partition.uuid)  # MIG-<uuid>, as NVIDIA names it
                devices.extend(Device(name, edits) for name in names)
            continue
        edits = _with_groups(ContainerEdits(device_nodes=tuple(rerooter.node(n) for n in item.nodes),
                                            hooks=_drm_by_path(item, opts)), opts, f"{profile.kind}={item.index}")
        if edits.is_empty():
            continue
        every_node.update(dict.fromkeys(edits.device_nodes))
        every_hook.update(dict.fromkeys(edits.hooks))
        devices.extend(Device(name, edits) for name in device_names(item, opts.strategies))
    if not devices:
        return None
    devices.append(Device("all", _with_groups(ContainerEdits(device_nodes=tuple(every_node),
                                                             hooks=tuple(every_hook)), opts, None)))
    return versioned(Spec(kind=profile.kind, devices=tuple(devices), edits=common), opts)


_DRM_BY_PATH = (("card", "card"), ("renderD", "render"))


def _drm_by_path(item: FoundDevice, opts: GenerateOptions) -> tuple[Hook, ...]:
    """`/dev/dri/by-path/pci-<address>-card` and `-render` links to the device's DRM nodes, as udev makes
    them on the host (Chromium, VA-API and GStreamer find a GPU's nodes by its PCI address through them)."""
    links = []
    for node in item.nodes:
        directory, name = posixpath.split(node.path)
        if directory != "/dev/dri":
            continue
        for prefix, suffix in _DRM_BY_PATH:
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                links.append(f"../{name}::/dev/dri/by-path/pci-{item.address}-{suffix}")
    if not links:
        return ()
    return (_cdi_hook(hook_command(opts.hook_path, target_root=opts.target_root), "create-symlinks",
                      ("--link", links)),)


def channel_spec(view: HostView, profile: Profile, common: ContainerEdits, rerooter: Rerooter,
                 opts: GenerateOptions) -> Spec | None:
    """A family of char-node devices (IMEX channels): device `N` for each `<directory>/<prefix>N` on the
    host, major from /proc/devices; none when the directory or the region is absent."""
    devices = [Device(c.name, ContainerEdits(device_nodes=(rerooter.node(c.node),)))
               for c in profile_channels(view, profile) if c.key not in opts.exclude]
    if not devices:
        return None
    every = ContainerEdits(device_nodes=tuple(n for d in devices for n in d.edits.device_nodes))
    return versioned(Spec(kind=profile.kind, devices=(*devices, Device("all", every)), edits=common), opts)


def _with_groups(edits: ContainerEdits, opts: GenerateOptions, what: str | None) -> ContainerEdits:
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


def versioned(spec: Spec, opts: GenerateOptions) -> Spec:
    """`spec` at the lowest CDI version its content needs; an error when that is above the cap."""
    needed = required_version(spec)
    if version_key(needed) > version_key(opts.version_cap):
        raise SpecError(f"{spec.kind}: content needs CDI {needed}, above the --cdi-version cap {opts.version_cap}")
    return spec._replace(cdi_version=needed)


def _enrich_uuids(found: list[FoundDevice], opts: GenerateOptions, host: Host) -> list[FoundDevice]:
    """UUIDs procfs does not give, from NVML (profiles with `uuid.nvml`): a GPU's, and its MIG devices'."""
    use_nvml = opts.nvml if opts.nvml is not None else host.root == "/"
    wanted = [f for f in found if f.profile.uuid_nvml and (not f.uuid or any(not p.uuid for p in f.partitions))]
    if not use_nvml or not wanted:
        return found
    from devinject.discovery.gpuinfo import nvml_gpus

    by_bus = nvml_gpus()
    out = []
    for item in found:
        gpu = by_bus.get(item.address) if item.profile.uuid_nvml else None
        if gpu is not None:
            item = replace(item, uuid=item.uuid or gpu.uuid, partitions=tuple(
                replace(p, uuid=p.uuid or gpu.mig.get((p.gpu_instance, p.compute_instance)))
                for p in item.partitions))
        out.append(item)
    return out


# --- the pipeline: select profiles -> discover -> edits -> specs (-> render -> write) ------------------
# `generate`, `watch` and `list` all go through these steps, so they cannot produce different specs.


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
    return profiles, _enrich_uuids(found, opts, node.host)


def _driver_files(host: Host, opts: GenerateOptions) -> tuple[Host, Rerooter] | None:
    """With --driver-root (a driver installed in a container, GPU-operator style, at e.g. /run/nvidia/driver
    as the host names it): its files are read under the host root and written as the host's runtime sees
    them, under the target root (or the host root); their container paths are the driver root's own."""
    if not opts.driver_root:
        return None
    inside = opts.driver_root.strip("/")
    files = Host(posixpath.join(host.root, inside))
    target = None if opts.target_root is None else posixpath.join(opts.target_root, inside)
    return files, Rerooter(files, target)


def build_specs(host: Host, profiles: list[Profile], found: list[FoundDevice], opts: GenerateOptions,
                view: HostView | None = None) -> list[Spec]:
    """One spec per kind with devices; devices whose `kind=address` is in `opts.exclude` are left out."""
    view = view or HostView(host)
    rerooter = Rerooter(host, opts.target_root)
    command = hook_command(opts.hook_path, target_root=opts.target_root)
    driver = _driver_files(host, opts)
    wants_cache = any(p.libraries or p.driver_libraries for p in profiles)
    ldcache = read_ldcache(driver[0] if driver else host) if wants_cache else []
    by_kind: dict[str, list[FoundDevice]] = {}
    for item in found:
        if device_key(item.profile.kind, item.address) not in opts.exclude:
            by_kind.setdefault(item.profile.kind, []).append(item)
    specs = []
    for profile in profiles:
        devices = by_kind.pop(profile.kind, [])
        if not devices:
            continue
        common = common_edits(view, profile, rerooter, command, ldcache, driver)
        spec = build_spec(profile, devices, common, rerooter, opts)
        if spec is not None:
            specs.append(spec)
    for profile in profiles:
        if profile.channels is not None:
            common = common_edits(view, profile, rerooter, command, ldcache, driver)
            channel = channel_spec(view, profile, common, rerooter, opts)
            if channel is not None:
                specs.append(channel)
    if "gpu-nic" in opts.bundles:
        from devinject.specs.bundles import gpu_nic_specs

        kept = [f for f in found if device_key(f.profile.kind, f.address) not in opts.exclude]
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


def spec_filename(spec: Spec, fmt: str) -> str:
    return f"{spec.vendor}-{spec.device_class}.{fmt}"


def render(spec: Spec, fmt: str, generation: int | None = None) -> str:
    from devinject.specs.validate import validate_spec

    text = dump(spec, fmt, generation=generation)
    validate_spec(spec, source=spec_filename(spec, fmt))
    return text


def write_specs(specs: list[Spec], output_dir: Path, fmt: str, *, managed: bool = False,
                stale_kinds: tuple[str, ...] = ()) -> list[Path]:
    """Validate every spec first, then write each atomically: an invalid one writes nothing at all.

    In a directory `watch` manages (or with `managed`, which makes it one) the rewrite carries the
    directory's next generation number and never replaces a newer one, and specs of `stale_kinds` (no
    devices left) are removed. Anywhere else the files are a pure function of the specs.
    """
    from devinject.core.spec import write_atomic
    from devinject.core.trusteddir import make_dirs

    if not output_dir.is_dir():
        try:
            make_dirs(str(output_dir))  # 0755 whatever the umask: a spec dir others can write is refused
        except OSError as err:
            raise DevinjectError(f"{output_dir}: cannot create output directory: {err.strerror}") from None
    rendered = {output_dir / spec_filename(spec, fmt): render(spec, fmt) for spec in specs}
    from devinject.specs import generation

    if managed or generation.managed(output_dir):
        stale = [output_dir / f"{kind.replace('/', '-')}.{fmt}" for kind in stale_kinds]
        generation.write_specs_generation(output_dir, rendered, stale)
    else:
        for path, text in rendered.items():
            write_atomic(path, text)
    return list(rendered)
