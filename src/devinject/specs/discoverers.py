"""The discoverers of a kind's spec-level edits: what finds, under the host root (or a driver root), the
running driver's version, its libraries, binaries, firmware and other files, its config files, the links
the libraries need and the folders of the linker cache, and the device nodes the kind's devices share.

Each answers with plain values (located files, a version, links); `common_edits` puts them together as one
`ContainerEdits`, with host paths as the host names them. What the spec's reader sees (the target root, the
mount options, the order, the CDI version) is the transforms' (specs/transforms.py). A new profile key that
finds something on the host is one discoverer here.
"""

from __future__ import annotations

import posixpath
import stat
from dataclasses import dataclass

from devinject.cdi.model import ContainerEdits, Mount
from devinject.discovery.discover import HostView, shared_nodes
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
)
from devinject.discovery.procfs import parse_nvidia_version
from devinject.discovery.profiles import Profile
from devinject.linux.ldcache import LdCacheEntry
from devinject.specs.hooks import HookCommand, library_hook


@dataclass(frozen=True, slots=True)
class FileSources:
    """Where a kind's files are read: `host` (device nodes, config files a driver root lacks) and `files` (the
    driver's libraries, binaries and files: a driver root, else the host itself). `driver_root`: that root as
    the host names it ("" without one), which the host paths of its files carry."""

    host: Host
    files: Host
    ldcache: tuple[LdCacheEntry, ...] = ()
    driver_root: str = ""

    def host_path(self, where: Host, path: str) -> str:
        """`path`, read in `where`, as the host names it."""
        if where is self.files and self.driver_root:
            return posixpath.join(self.driver_root, path.lstrip("/"))
        return path


def driver_version(host: Host, profile: Profile, libraries: list[LocatedFile]) -> str | None:
    """The running driver's version: its procfs file, its module's version, else the suffix of a library
    found (`libcuda.so.1 -> libcuda.so.550.54.14`)."""
    if profile.driver_version_file:
        version = parse_nvidia_version(host.read_text(profile.driver_version_file) or "")
        if version:
            return version
    if profile.driver_module:
        version = host.read_attr(f"/sys/module/{profile.driver_module}/version")
        if version:
            return version
    for library in libraries:
        base = posixpath.basename(library.real)
        _, _, suffix = base.partition(".so.")
        if suffix.count(".") >= 1 and suffix.replace(".", "").isdigit():
            return suffix
    return None


def discover_libraries(sources: FileSources, profile: Profile) -> tuple[list[LocatedFile], str | None]:
    """The profile's `libraries` and `driver-libraries`, and the running driver's version. A pattern with
    `{driver_version}` (`libnvidia-gpucomp.so.{driver_version}`) takes only that version's library, once the
    version is known (procfs, the module, or else the suffix of a library the other patterns found); an old
    driver's left behind is not mounted."""
    files, ldcache = sources.files, list(sources.ldcache)
    fixed = tuple(p for p in profile.libraries if DRIVER_VERSION_FIELD not in p)
    libraries = locate_libraries(files, ldcache, fixed, native_arch()) if fixed else []
    version = driver_version(sources.host, profile, libraries)
    pinned = expand_fields(tuple(p for p in profile.libraries if p not in fixed), driver_version=version)
    if pinned:
        known = {lib.path for lib in libraries}
        libraries += [lib for lib in locate_libraries(files, ldcache, tuple(pinned), native_arch())
                      if lib.path not in known]
        libraries.sort(key=lambda lib: lib.path)
    if profile.driver_libraries:
        known = {lib.real for lib in libraries}
        libraries += [lib for lib in locate_driver_libraries(files, ldcache, profile.driver_libraries,
                                                             native_arch(), version) if lib.real not in known]
        libraries.sort(key=lambda lib: lib.path)
    return libraries, version


def discover_driver_files(sources: FileSources, profile: Profile, version: str | None) -> list[LocatedFile]:
    """The profile's `binaries` and `files` (firmware and the rest, `{driver_version}` filled in)."""
    return locate_binaries(sources.files, profile.binaries) + locate_files(sources.files, profile.files,
                                                                           driver_version=version)


def _first_file(hosts: list[Host], candidates: tuple[str, ...]) -> tuple[Host, LocatedFile] | None:
    """The first candidate path that is a regular file (links followed inside the root), and where."""
    for where in hosts:
        for path in candidates:
            real = where.resolve(path)
            st = where.lstat(real)
            if st is not None and stat.S_ISREG(st.st_mode):
                return where, LocatedFile(path, real)
    return None


def discover_mounts(sources: FileSources, profile: Profile, libraries: list[LocatedFile],
                    driver_files: list[LocatedFile]) -> dict[str, Mount]:
    """What the kind mounts, by what found it: its libraries (at their real paths), its `library-dirs`, its
    driver files, and the first of each config file's candidates (a driver root's, else the host's)."""
    files = sources.files
    mounts: dict[str, Mount] = {}
    for library in libraries:
        mounts.setdefault(library.real, Mount(sources.host_path(files, library.real), library.real))
    for directory in profile.library_dirs:
        if files.is_dir(directory):
            mounts.setdefault(directory, Mount(sources.host_path(files, files.resolve(directory)), directory))
    for located in driver_files:
        mounts.setdefault(located.path, Mount(sources.host_path(files, located.real), located.path))
    for config in profile.config_files:
        chosen = _first_file([files, sources.host] if sources.driver_root else [files], config.host)
        if chosen is not None:
            where, found = chosen
            mounts.setdefault(config.container, Mount(sources.host_path(where, found.real), config.container))
    return mounts


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


def discover_links(sources: FileSources, profile: Profile, libraries: list[LocatedFile],
                   driver_files: list[LocatedFile], version: str | None) -> list[str]:
    """The links the container needs (TARGET::LINK): each library's name to its real file, then the
    development and declared links (`_development_links`)."""
    links = [f"{_link_target(lib)}::{lib.path}" for lib in libraries if lib.real != lib.path]
    return links + _development_links(sources.files, libraries, profile.links, driver_files, version)


def _holds_library(files: Host, directory: str) -> bool:
    """Whether a library directory of the profile's holds a shared library: one that holds none needs no
    linker cache change in the container."""
    return any(".so" in name and not files.is_dir(posixpath.join(directory, name)) for name in files.listdir(directory))


def discover_linker_folders(sources: FileSources, profile: Profile, libraries: list[LocatedFile],
                            mounts: dict[str, Mount]) -> list[str]:
    """The folders the container's linker cache must know: the libraries', and each mounted library dir
    that holds a library."""
    return sorted({posixpath.dirname(lib.real) for lib in libraries} | {
        d for d in profile.library_dirs if d in mounts and _holds_library(sources.files, d)})


def forward_compat(profile: Profile, version: str | None, folders: list[str]) -> list[str]:
    """The profile's forward-compatibility rule as the hook takes it (DIR:LIB:VERSION; CUDA's: an image's
    newer libcuda comes first), when the version is known and a linker cache is made."""
    if not (profile.forward_compat and version and folders):
        return []
    compat_dir, compat_lib = profile.forward_compat
    return [f"{compat_dir}:{compat_lib}:{version}"]


@dataclass(frozen=True, slots=True)
class DriverEdits:
    """A kind's spec-level edits as the driver's files give them, before the hook that the container's own
    devices complete (their links, their GPUs): what a server building a spec per claim keeps between claims."""

    edits: ContainerEdits  # env, shared nodes, mounts
    links: tuple[str, ...] = ()
    folders: tuple[str, ...] = ()
    forward_compat: tuple[str, ...] = ()
    graphics: bool = False  # the driver's EGL or Vulkan is mounted (the profile's application-profile `needs`)


def driver_edits(view: HostView, profile: Profile, sources: FileSources) -> DriverEdits:
    """The kind's spec-level edits, as the host names its paths: shared device nodes from the host; driver
    files (libraries, binaries, firmware and other files) from a driver root or else the host too; the links
    and linker cache folders the hook makes of them."""
    libraries, version = discover_libraries(sources, profile)
    driver_files = discover_driver_files(sources, profile, version)
    mounts = discover_mounts(sources, profile, libraries, driver_files)
    folders = discover_linker_folders(sources, profile, libraries, mounts)
    rule = profile.application_profile
    return DriverEdits(
        ContainerEdits(env=profile.env, device_nodes=tuple(shared_nodes(view, profile)),
                       mounts=tuple(mounts.values())),
        tuple(discover_links(sources, profile, libraries, driver_files, version)),
        tuple(folders),
        tuple(forward_compat(profile, version, folders)),
        rule is not None and any(path in mounts for path in rule.needs),
    )


def with_hook(found: DriverEdits, command: HookCommand, device_links: tuple[str, ...] = (),
              gpu_nodes: tuple[str, ...] = ()) -> ContainerEdits:
    """`found`'s edits with the one hook that makes their links and linker cache, the `device_links` of the
    container's devices and the application profile of its GPUs (of `gpu_nodes`, where the driver's EGL or
    Vulkan is there to read it; none for a compute-only install)."""
    hooks = library_hook(command, list(found.links), list(found.folders), list(found.forward_compat), device_links,
                         gpu_nodes if found.graphics else ())
    return found.edits._replace(hooks=hooks)


def common_edits(view: HostView, profile: Profile, sources: FileSources, command: HookCommand,
                 device_links: tuple[str, ...] = (), gpu_nodes: tuple[str, ...] = ()) -> ContainerEdits:
    """The kind's spec-level edits (`driver_edits`) with their hook (`with_hook`)."""
    return with_hook(driver_edits(view, profile, sources), command, device_links, gpu_nodes)
