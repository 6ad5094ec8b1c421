"""The action planner: resolved CDI edits -> the exact steps the hook takes. Pure: the only outside input is
an injectable `stat` for device nodes whose numbers the spec leaves out."""

from __future__ import annotations

import posix  # not `os`, ~0.9 ms of imports: the hook runs this on every container start
import stat as statmod

from devinject.core.errors import HookError
from devinject.hook.purepath import dirname, join, normpath

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:  # the CDI model only as types: a cdi-hook's start imports neither
    from collections.abc import Callable
    from typing import NamedTuple

    from devinject.cdi.identity import NodeId
    from devinject.cdi.model import ContainerEdits, DeviceNode, Hook, NetDevice
    from devinject.linux.devcgroup import AllowDevice as AllowDevice  # a device cgroup rule: the plan's, the ledger's

    StatFn = Callable[[str], posix.stat_result]
else:
    from devinject.core.records import NamedTuple


def __getattr__(name: str) -> object:
    """`AllowDevice` (the plan's device cgroup rule) from linux/devcgroup.py when first asked for: a cdi-hook
    makes no rule, and its start does not load that module."""
    if name == "AllowDevice":
        from devinject.linux.devcgroup import AllowDevice

        return AllowDevice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_ACTIONS = 4096
_MOUNT_FLAGS = {"ro": "readonly", "nosuid": "nosuid", "nodev": "nodev", "noexec": "noexec"}
_IGNORED_OPTIONS = {"bind", "rbind", "rprivate", "private", "rslave", "slave", "rw", "suid", "dev", "exec",
                    "rshared", "shared"}


class MakeNode(NamedTuple):
    path: str
    type: str
    major: int
    minor: int
    mode: int
    uid: int
    gid: int
    host_path: str


class BindMount(NamedTuple):
    host_path: str
    container_path: str
    readonly: bool = True
    nosuid: bool = True
    nodev: bool = True
    noexec: bool = False
    recursive: bool = False


class Symlink(NamedTuple):
    target: str
    link: str


class Plan(NamedTuple):
    nodes: tuple[MakeNode, ...] = ()
    mounts: tuple[BindMount, ...] = ()
    links: tuple[Symlink, ...] = ()
    ldcache_folders: tuple[str, ...] = ()
    allow: tuple[AllowDevice, ...] = ()
    warnings: tuple[str, ...] = ()
    net_devices: tuple[NetDevice, ...] = ()
    forward_compat: tuple[ForwardCompat, ...] = ()  # checked in the image at ldcache time
    gpu_minors: tuple[int, ...] = ()  # the application profile's GPUs (EGLVisibleDGPUDevices): none, no file

    @property
    def size(self) -> int:
        return len(self.nodes) + len(self.mounts) + len(self.links) + len(self.allow) + len(self.net_devices)




def _fill_node(node: DeviceNode, stat_fn: StatFn, uid: int, gid: int) -> MakeNode:
    host_path = node.host_path or node.path
    kind, major, minor, mode = node.type, node.major, node.minor, node.file_mode
    if not kind or major is None or minor is None or mode is None:
        try:
            st = stat_fn(host_path)
        except OSError as err:
            if not kind or major is None or minor is None:
                raise HookError(f"device node {node.path}: numbers not in the spec and {host_path}: "
                                f"{err.strerror}") from None
        else:
            if statmod.S_ISCHR(st.st_mode) or statmod.S_ISBLK(st.st_mode):
                kind = kind or ("c" if statmod.S_ISCHR(st.st_mode) else "b")
                major = posix.major(st.st_rdev) if major is None else major
                minor = posix.minor(st.st_rdev) if minor is None else minor
                mode = statmod.S_IMODE(st.st_mode) if mode is None else mode
            elif not kind or major is None or minor is None:
                raise HookError(f"device node {node.path}: {host_path} is not a device node")
    if kind not in ("c", "b"):
        raise HookError(f"device node {node.path}: type {kind!r} cannot be created by the hook (c or b only)")
    if not node.path.startswith("/"):
        raise HookError(f"device node {node.path}: path must be absolute")
    assert major is not None and minor is not None
    return MakeNode(node.path, kind, major, minor, 0o666 if mode is None else statmod.S_IMODE(mode),
                    uid if node.uid is None else node.uid, gid if node.gid is None else node.gid, host_path)


def node_identity(node: DeviceNode, stat_fn: StatFn = posix.stat) -> NodeId:
    """`c 195:0`: what the ledger books. Numbers a spec leaves out come from the host node, as for mknod,
    so a node written without major/minor (as other generators write them) is still one device."""
    from devinject.cdi.identity import node_id

    filled = _fill_node(node, stat_fn, 0, 0)
    return node_id(filled.type, filled.major, filled.minor)


def _bind(host_path: str, container_path: str, options: tuple[str, ...], mount_type: str | None) -> BindMount:
    if mount_type not in (None, "", "bind", "none"):
        raise HookError(f"mount {container_path}: type {mount_type!r} not supported by the hook (bind only)")
    if not container_path.startswith("/") or not host_path.startswith("/"):
        raise HookError(f"mount {container_path}: host and container paths must be absolute")
    flags = {"readonly": False, "nosuid": False, "nodev": False, "noexec": False}
    for option in options:
        if option in _MOUNT_FLAGS:
            flags[_MOUNT_FLAGS[option]] = True
        elif option not in _IGNORED_OPTIONS:
            raise HookError(f"mount {container_path}: option {option!r} not supported by the hook")
    return BindMount(host_path, container_path, recursive="rbind" in options, **flags)


def _devinject_hook_args(hook: Hook) -> list[str] | None:
    """Args after `cdi-hook` when this is a hook devinject generated, else None: `devinject cdi-hook ...` (a
    console script, the node hook's launcher), `PYTHON -IS .../devinject/hook/launcher.py cdi-hook ...`, or the
    node hook's loader running its interpreter on `-c BUNDLED_ENTRY cdi-hook ...`."""
    args = list(hook.args)
    if len(args) >= 3 and args[0].rpartition("/")[2] == "devinject" and args[1] == "cdi-hook":
        return args[2:]
    if len(args) >= 5 and args[1] == "-IS" and args[2].endswith(LAUNCHER_SUFFIX) and args[3] == "cdi-hook":
        return args[4:]
    for index in range(1, len(args) - 1):
        if args[index] == BUNDLED_ENTRY and args[index - 1] == "-c" and args[index + 1] == "cdi-hook":
            return args[index + 2:]
    return None


LAUNCHER_SUFFIX = "/devinject/hook/launcher.py"  # the hook launcher, as generate names it in a spec
BUNDLED_ENTRY = "from devinject.hook.bundled import run; run()"  # the node hook's interpreter runs this (-c)


_LINK_FLAG = ("--link", "TARGET::LINK", "make LINK (an absolute path in the container) a symlink to TARGET")
_DEVICE_LINK_FLAG = ("--device-link", "TARGET::LINK",
                     "make LINK only when the container was given TARGET (from LINK's directory) as a device node")
_FOLDER_FLAG = ("--folder", "DIR", "a directory of the driver's libraries in the container")
_FORWARD_COMPAT_FLAG = ("--forward-compat", "DIR:LIBRARY:VERSION",
                        "DIR first when the image's LIBRARY.<version> there is newer than VERSION, the host driver's")
_APPLICATION_PROFILE_FLAG = ("--application-profile", "NODE",
                             "a GPU's device node: the driver's application profile in the container lets EGL and "
                             "Vulkan see only the GPUs of these the container was given")
CDI_HOOK_COMMANDS = {  # subcommand -> (what it does, its flags: (flag, value, meaning)); parsing and --help read it
    "create-symlinks": ("Make symlinks in the container, as the host's driver has them (the soname links).", (
        _LINK_FLAG, _DEVICE_LINK_FLAG,
    )),
    "update-ldcache": ("Add library directories to the container's linker cache (ld.so.cache, or musl's path).", (
        _FOLDER_FLAG, _FORWARD_COMPAT_FLAG,
    )),
    "update-application-profile": ("Write the driver's application profile for the container's GPUs "
                                   "(EGLVisibleDGPUDevices), as NVIDIA's hook of that name.", (
        _APPLICATION_PROFILE_FLAG,
    )),
    "links-and-ldcache": ("Make the symlinks, then add the library directories to the linker cache (and write "
                          "the application profile): the other subcommands in one process.", (
        _LINK_FLAG, _DEVICE_LINK_FLAG, _FOLDER_FLAG, _FORWARD_COMPAT_FLAG, _APPLICATION_PROFILE_FLAG,
    )),
}


def cdi_hook_usage(command: str | None = None) -> str:
    """`cdi-hook --help`: each subcommand's usage line; `cdi-hook COMMAND --help`: its own, and its flags."""
    def usage(name: str) -> str:
        flags = " ".join(f"[{flag} {value}]..." for flag, value, _ in CDI_HOOK_COMMANDS[name][1])
        return f"devinject cdi-hook {name} {flags} < state.json"

    if command not in CDI_HOOK_COMMANDS:
        lines = [("usage: " if i == 0 else "       ") + usage(name) for i, name in enumerate(CDI_HOOK_COMMANDS)]
        return "\n".join([*lines, "", "The specs' CDI createContainer hooks, run in the container's mount namespace.",
                          "`devinject cdi-hook COMMAND --help` lists its flags."])
    summary, flags = CDI_HOOK_COMMANDS[command]
    width = max(len(f"{flag} {value}") for flag, value, _ in flags)
    return "\n".join([f"usage: {usage(command)}", "", summary, "", "flags (each repeatable; --flag=value too):",
                      *(f"  {f'{flag} {value}':{width}}  {meaning}" for flag, value, meaning in flags),
                      "", "--server SOCKET hands the work to the hook server there (default: its usual socket, "
                      "when one listens); --no-server runs it here."])


def parse_cdi_hook(args: list[str]) -> tuple[str, dict[str, list[str]]]:
    """`create-symlinks --link T::L ...`, `update-ldcache --folder F ... [--forward-compat DIR:LIB:VERSION]`,
    `update-application-profile --application-profile NODE ...` or `links-and-ldcache` with the flags of all
    -> (subcommand, values by flag: every flag of the table, a subcommand's own flags or not, so that callers
    need not ask which it was)."""
    if not args:
        raise HookError("cdi-hook: subcommand missing (create-symlinks, update-ldcache, update-application-profile "
                        "or links-and-ldcache)")
    command, rest = args[0], args[1:]
    if command not in CDI_HOOK_COMMANDS:
        raise HookError(f"cdi-hook: unknown subcommand {command!r}")
    own = {flag for flag, _, _ in CDI_HOOK_COMMANDS[command][1]}
    values: dict[str, list[str]] = {flag: [] for flag in ("--link", "--device-link", "--folder", "--forward-compat",
                                                          "--application-profile")}
    i = 0
    while i < len(rest):
        arg = rest[i]
        flag, eq, value = arg.partition("=")
        if flag in own and eq:
            values[flag].append(value)
            i += 1
        elif arg in own and i + 1 < len(rest):
            values[arg].append(rest[i + 1])
            i += 2
        elif (flag == "--server" and (eq or i + 1 < len(rest))) or arg == "--no-server":
            i += 1 if eq or arg == "--no-server" else 2  # the launcher's: which hook server (hook/client.py)
        else:
            raise HookError(f"cdi-hook {command}: unexpected argument {arg!r}")
    return command, values


class ForwardCompat(NamedTuple):
    """Newer user-space driver libraries an image may carry (CUDA forward compatibility): `directory` in the
    image, `library` the name their versions follow (`libcuda.so.<version>`), `host_version` the driver's."""

    directory: str
    library: str
    host_version: str


def parse_forward_compat(value: str) -> ForwardCompat:
    directory, _, rest = value.partition(":")
    library, _, version = rest.partition(":")
    if not directory.startswith("/") or not library or "/" in library or not _version_key(version):
        raise HookError(f"--forward-compat {value!r}: expected /dir:library:host-version")
    return ForwardCompat(directory, library, version)


def _version_key(version: str) -> tuple[int, ...]:
    from devinject.core.asciitext import is_digits  # here: a --forward-compat alone needs it (NVIDIA specs name one)

    parts = version.split(".")  # from a file name in the image: libcuda.so.5²0.1 is no version
    return tuple(int(p) for p in parts) if parts and all(is_digits(p) for p in parts) else ()


def newer_than(version: str, host_version: str) -> bool:
    """`560.35.03` newer than `550.54.14` (numeric, part by part); anything unparsable is not newer."""
    mine, host = _version_key(version), _version_key(host_version)
    return bool(mine) and bool(host) and mine > host


def parse_link(value: str, flag: str = "--link") -> Symlink:
    target, sep, link = value.partition("::")
    if not sep or not target or not link.startswith("/"):
        raise HookError(f"cdi-hook create-symlinks: {flag} {value!r} is not TARGET::/ABSOLUTE/LINK")
    return Symlink(target, link)


def device_links(values: list[str], given: set[str]) -> list[Symlink]:
    """The `--device-link`s whose target is a device node the container was given (`given`: container paths,
    normalized). A spec names every device's own links (a GPU's /dev/dri/by-path ones) in its one spec-level
    hook, so that a container of any of its devices starts one hook process; each container gets its own
    devices' links only, never a link naming another device's PCI address."""
    links = [parse_link(v, "--device-link") for v in values]
    return [s for s in links if normpath(join(dirname(s.link), s.target)) in given]


APPLICATION_PROFILE = "/etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf"  # where the driver reads it
APPLICATION_PROFILE_BITS = 64  # EGLVisibleDGPUDevices is a 64-bit mask: bit N for the GPU of minor N


def gpu_minors(values: list[str], given: dict[str, int]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The minors of the `--application-profile` nodes the container was given (`given`: its char device
    nodes' minors by normalized container path), sorted, and a warning for each that no mask can hold."""
    named = {normpath(v) for v in values if v.startswith("/")}
    minors = sorted({minor for path, minor in given.items() if path in named})
    dropped = tuple(f"application profile: GPU minor {m} left out (EGLVisibleDGPUDevices holds minors 0-"
                    f"{APPLICATION_PROFILE_BITS - 1})" for m in minors if not 0 <= m < APPLICATION_PROFILE_BITS)
    return tuple(m for m in minors if 0 <= m < APPLICATION_PROFILE_BITS), dropped


def application_profile(minors: tuple[int, ...]) -> bytes:
    """The driver's application profile that shows EGL and Vulkan only the GPUs of `minors`, byte for byte as
    NVIDIA's `nvidia-cdi-hook update-application-profile` writes it (one rule for every program; the mask in
    hex, which the driver's profile parser takes though JSON has no hex)."""
    mask = sum(1 << minor for minor in set(minors))
    return ('{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",0x' + format(mask, "x")
            + ']}],"rules":[{"pattern":[],"profile":"_container_"}]}').encode()


def plan(edits: ContainerEdits, *, stat_fn: StatFn = posix.stat, uid: int = 0, gid: int = 0) -> Plan:
    nodes = tuple(_fill_node(n, stat_fn, uid, gid) for n in edits.device_nodes)
    mounts = [_bind(m.host_path, m.container_path, m.options, m.type) for m in edits.mounts]
    mounts.sort(key=lambda m: normpath(m.container_path).count("/"))  # parents before children
    links: list[Symlink] = []
    folders: list[str] = []
    compat: list[ForwardCompat] = []
    profile_nodes: list[str] = []
    warnings = []
    # What only the runtime can apply: the process's env and groups and its resctrl class are fixed by now.
    if edits.env:
        warnings.append(f"{len(edits.env)} env edit(s) ignored: a runtime hook cannot change the container's env")
    if edits.additional_gids:
        warnings.append(f"additionalGids {list(edits.additional_gids)} ignored: a runtime hook cannot change "
                        "the container process's groups")
    if edits.intel_rdt is not None:
        warnings.append("intelRdt ignored: a runtime hook cannot change the container's resctrl class")
    for hook in edits.hooks:
        args = _devinject_hook_args(hook)
        if args is None:
            warnings.append(f"hook {hook.path} ({hook.hook_name}) skipped: only devinject's own hooks run inline")
            continue
        _, values = parse_cdi_hook(args)
        links += [parse_link(v) for v in values["--link"]]
        links += device_links(values["--device-link"], {normpath(n.path) for n in edits.device_nodes})
        folders += [v for v in values["--folder"] if v.startswith("/")]
        compat += [parse_forward_compat(v) for v in values["--forward-compat"]]
        profile_nodes += values["--application-profile"]
    minors, dropped = gpu_minors(profile_nodes, {normpath(n.path): n.minor for n in nodes if n.type == "c"})
    warnings += dropped
    from devinject.linux.devcgroup import AllowDevice

    allow = tuple(dict.fromkeys(AllowDevice(n.type, n.major, n.minor, _access(d.permissions))
                                for n, d in zip(nodes, edits.device_nodes, strict=True)))
    result = Plan(tuple(nodes), tuple(mounts), tuple(dict.fromkeys(links)), tuple(dict.fromkeys(folders)), allow,
                  tuple(warnings), edits.net_devices, tuple(dict.fromkeys(compat)), minors)
    if result.size > MAX_ACTIONS:
        raise HookError(f"{result.size} actions requested; at most {MAX_ACTIONS}")
    return result


def _access(permissions: str | None) -> str:
    if not permissions:
        return "rwm"
    if any(ch not in "rwm" for ch in permissions):
        raise HookError(f"device permissions {permissions!r}: only r, w, m")
    return "".join(ch for ch in "rwm" if ch in permissions)
