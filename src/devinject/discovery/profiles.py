"""Device families as data. A profile says which PCI functions belong to a CDI kind and what a container
needs to use them; the mechanisms it names (class devices, procfs minors, IOMMU groups, ...) are generic.

Shipped profiles live in `devinject/data/profiles/*.yaml`; an admin adds or replaces one (same `name`) with a
file in `<root>/etc/devinject/profiles.d/`. `docs/profiles.md` documents every field.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from devinject.cdi.names import kind_problem
from devinject.core.errors import ConfigError
from devinject.core.paths import profile_search_path
from devinject.discovery.host import Host
from devinject.discovery.sysfs import PciDevice

SHARING_MODES = ("exclusive", "shared")
MOUNT_OPTIONS = frozenset({"ro", "rw", "nosuid", "suid", "nodev", "dev", "noexec", "exec", "bind", "rbind"})


@dataclass(frozen=True, slots=True)
class NodeRule:
    """Where a device's char nodes come from. Exactly one source is set."""

    class_name: str | None = None  # child class devices of the PCI function: <fn>/<class>/<name>
    names: tuple[str, ...] = ("*",)  # globs on the class device name
    proc_file: str | None = None  # procfs file with a minor number (NVIDIA's `information`)
    proc_key: str | None = None
    path: str | None = None  # /dev path template, `{minor}` / `{index}` / `{group}` filled in
    region: str | None = None  # /proc/devices region giving the major
    major: int | None = None
    minor: int | None = None
    sysfs: str | None = None  # class device (glob allowed) whose dev/uevent give the node
    iommu_group: bool = False  # VFIO: /dev/vfio/<group>
    optional: bool = False


@dataclass(frozen=True, slots=True)
class HealthFlag:
    """The driver's own verdict: `key` in a key/value file (procfs), unhealthy when it reads `unhealthy`."""

    file: str  # `{address}` filled in
    key: str
    unhealthy: str


@dataclass(frozen=True, slots=True)
class KernelLogErrors:
    """Errors the driver logs per device: a regex with `slot` (domain:bus:device) and `code` groups, and the
    codes that mean the device is gone (NVIDIA's fatal Xids, for example)."""

    name: str
    pattern: str
    fatal: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DriverLibraries:
    """Every library the driver installed, found as the driver lays them out rather than by a fixed list:
    in the directory of `anchor` (a SONAME found through ld.so.cache), every file matching one of `patterns`
    (`{driver_version}` filled in), also in its `subdirs`, minus `exclude`."""

    anchor: str
    patterns: tuple[str, ...]
    subdirs: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PartitionRule:
    """A device offered as its partitions when it has several (discovery.partitions): `nvidia-mig` reads the
    MIG capability directory `source`, `amd-kfd` the KFD topology nodes in `source` (`{device_minor}`: the
    device node's minor); `node` is a partition node's path (`{minor}`), its major from /proc/devices
    `region`; `shared` lists capability files every partition gets (MIG's read-only `monitor`)."""

    type: str
    source: str
    node: str
    region: str
    shared: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Channels:
    """Devices that are char nodes, not PCI functions (NVIDIA's IMEX channels): every node in `directory`
    named `prefix<N>` is device `N`, major from /proc/devices `region`, minor N."""

    directory: str
    prefix: str
    region: str


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """A loader's configuration file (an ICD JSON, say), mounted read-only at `container`, the path the
    loader reads in the container, from the first of `host` that exists."""

    container: str
    host: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ApplicationProfileRule:
    """The driver's application profile that shows its EGL and Vulkan only the container's GPUs (NVIDIA's
    EGLVisibleDGPUDevices): `gpu_node` names a GPU's node by its minor (`/dev/nvidia{minor}`); the spec's hook
    writes it only where the driver's EGL or Vulkan is there to read it, one of `needs` (config files'
    container paths) mounted."""

    gpu_node: str
    needs: tuple[str, ...]

    def names_gpu(self, path: str) -> bool:
        """Whether `path` is a GPU's node (`/dev/nvidia3`, not `/dev/nvidiactl`)."""
        prefix, _, suffix = self.gpu_node.partition("{minor}")
        middle = path[len(prefix):len(path) - len(suffix)] if len(path) > len(prefix) + len(suffix) else ""
        return path.startswith(prefix) and path.endswith(suffix) and middle.isdigit()


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    kind: str
    source: str
    vendors: tuple[int, ...] = ()
    class_prefixes: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    priority: int = 0
    group_by: str = "function"
    sharing: str = "exclusive"
    device_nodes: tuple[NodeRule, ...] = ()
    shared_nodes: tuple[NodeRule, ...] = ()
    uuid_file: str | None = None
    uuid_key: str | None = None
    uuid_nvml: bool = False  # ask NVML for UUIDs procfs does not give (NVIDIA)
    vendor_name: str = ""  # how `list` names the vendor
    request_env: tuple[str, ...] = ()  # env variables other vendors' hooks read, mapped onto this kind
    uevents: tuple[str, ...] = ()  # kernel subsystems whose uevents mean this family changed
    mount_options: tuple[tuple[str, tuple[str, ...]], ...] = ()  # container-path glob -> options
    health_flags: tuple[HealthFlag, ...] = ()
    kernel_log: KernelLogErrors | None = None
    driver_module: str | None = None
    driver_version_file: str | None = None
    libraries: tuple[str, ...] = ()
    driver_libraries: DriverLibraries | None = None
    links: tuple[tuple[str, str], ...] = ()  # (link, target) names in a mounted library's directory
    config_files: tuple[ConfigFile, ...] = ()
    partitions: PartitionRule | None = None
    forward_compat: tuple[str, str] | None = None  # (directory in images, library name): newer ones win
    channels: Channels | None = None  # a family of char-node devices: matches no PCI function
    application_profile: ApplicationProfileRule | None = None
    library_dirs: tuple[str, ...] = ()
    binaries: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    models: tuple[tuple[int, str], ...] = ()
    description: str = ""

    def matches(self, pci: PciDevice) -> bool:
        if self.channels is not None:
            return False
        if self.vendors and pci.vendor not in self.vendors:
            return False
        if self.class_prefixes and not any(pci.class_hex.startswith(p) for p in self.class_prefixes):
            return False
        return not self.drivers or pci.driver in self.drivers

    def model(self, pci: PciDevice) -> str | None:
        return dict(self.models).get(pci.device)


class _Fields:
    """Strict reader for one mapping in a profile file; errors name the file and the field."""

    def __init__(self, data: object, where: str, allowed: AbstractSet[str]) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping")
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown field")
        self.data: dict[str, Any] = data
        self.where = where

    def text(self, key: str, default: str | None = None, *, required: bool = False) -> Any:
        value = self.data.get(key, default)
        if value is None and required:
            raise ConfigError(f"{self.where}.{key}: required")
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{self.where}.{key}: expected a string")
        return value

    def integer(self, key: str) -> int | None:
        value = self.data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{self.where}.{key}: expected an integer")
        return value

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}.{key}: expected true or false")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.where}.{key}: expected a list of strings")
        return tuple(value)

    def choice(self, key: str, default: str, allowed: tuple[str, ...], expected: str) -> str:
        value: str = self.text(key, default)
        if value not in allowed:
            raise ConfigError(f"{self.where}.{key}: {expected}")
        return value

    def hex_ids(self, key: str) -> tuple[int, ...]:
        out = []
        for text in self.strings(key):
            try:
                out.append(int(text, 16))
            except ValueError:
                raise ConfigError(f"{self.where}.{key}: {text!r} is not a hex id") from None
        return tuple(out)


def _node_rule(data: object, where: str) -> NodeRule:
    f = _Fields(data, where, {"class", "names", "proc-file", "proc-key", "path", "region", "major", "minor",
                              "sysfs", "iommu-group", "optional"})
    rule = NodeRule(
        class_name=f.text("class"),
        names=f.strings("names") or ("*",),
        proc_file=f.text("proc-file"),
        proc_key=f.text("proc-key"),
        path=f.text("path"),
        region=f.text("region"),
        major=f.integer("major"),
        minor=f.integer("minor"),
        sysfs=f.text("sysfs"),
        iommu_group=f.flag("iommu-group"),
        optional=f.flag("optional"),
    )
    sources = [rule.class_name, rule.proc_file, rule.sysfs, rule.iommu_group or None,
               rule.path if not (rule.proc_file or rule.sysfs) else None]
    if sum(s is not None for s in sources) != 1:
        raise ConfigError(f"{where}: give exactly one of class, proc-file, sysfs, iommu-group, path")
    if rule.proc_file and not (rule.proc_key and rule.path):
        raise ConfigError(f"{where}: proc-file needs proc-key and path")
    if rule.path and not (rule.proc_file or rule.sysfs) and (rule.minor is None or (
            rule.major is None and rule.region is None)):
        raise ConfigError(f"{where}: a fixed path needs minor and one of major, region")
    return rule


def _mount_options(data: object, where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`{"/run/acme/*": [rw, nosuid, nodev, bind]}`: the options of the mounts whose container path matches
    (first match wins); every other driver file is mounted ro, nosuid, nodev."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of container path globs to option lists")
    out = []
    for pattern, options in data.items():
        if not isinstance(pattern, str) or not pattern.startswith("/"):
            raise ConfigError(f"{where}: {pattern!r} is not an absolute path or glob")
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise ConfigError(f"{where}.{pattern}: expected a list of options")
        unknown = [o for o in options if o not in MOUNT_OPTIONS]
        if unknown:
            raise ConfigError(f"{where}.{pattern}: unknown option {unknown[0]!r} (known: "
                              f"{', '.join(sorted(MOUNT_OPTIONS))})")
        if not {"bind", "rbind"} & set(options):
            raise ConfigError(f"{where}.{pattern}: driver files are bind mounts: add bind or rbind")
        out.append((pattern, tuple(options)))
    return tuple(out)


def _health(data: object, where: str) -> tuple[tuple[HealthFlag, ...], KernelLogErrors | None]:
    """The `health` section: the driver's flags, and the errors it logs in the kernel log."""
    health = _Fields(data, where, {"flags", "kernel-log"})
    return _health_flags(health.data.get("flags", []), where), _kernel_log(health.data.get("kernel-log"), where)


def _health_flags(flags: object, where: str) -> tuple[HealthFlag, ...]:
    if not isinstance(flags, list):
        raise ConfigError(f"{where}.flags: expected a list")
    out = []
    for i, item in enumerate(flags):
        flag = _Fields(item, f"{where}.flags[{i}]", {"proc-file", "key", "unhealthy"})
        out.append(HealthFlag(flag.text("proc-file", required=True), flag.text("key", required=True),
                              flag.text("unhealthy", required=True)))
    return tuple(out)


def _kernel_log(raw: object, where: str) -> KernelLogErrors | None:
    if raw is None:
        return None
    log = _Fields(raw, f"{where}.kernel-log", {"name", "pattern", "fatal"})
    pattern = log.text("pattern", required=True)
    try:
        groups = re.compile(pattern).groupindex
    except re.error as err:
        raise ConfigError(f"{where}.kernel-log.pattern: not a regular expression: {err}") from None
    if not {"slot", "code"} <= set(groups):
        raise ConfigError(f"{where}.kernel-log.pattern: needs the named groups (?P<slot>...) and (?P<code>...)")
    fatal = log.data.get("fatal", [])
    if not isinstance(fatal, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in fatal):
        raise ConfigError(f"{where}.kernel-log.fatal: expected a list of numbers")
    return KernelLogErrors(log.text("name", "error"), pattern, tuple(fatal))


def _driver_libraries(raw: object, where: str) -> DriverLibraries | None:
    if raw is None:
        return None
    f = _Fields(raw, where, {"anchor", "patterns", "subdirs", "exclude"})
    patterns = f.strings("patterns")
    if not patterns:
        raise ConfigError(f"{where}.patterns: required (e.g. '*.so.{{driver_version}}')")
    for name in (*patterns, *f.strings("exclude")):
        if "/" in name:
            raise ConfigError(f"{where}: {name!r}: a file name pattern, not a path")
    for sub in f.strings("subdirs"):
        if sub.startswith("/") or ".." in sub.split("/"):
            raise ConfigError(f"{where}.subdirs: {sub!r}: a directory below the anchor's, not a path")
    return DriverLibraries(f.text("anchor", required=True), patterns, f.strings("subdirs"), f.strings("exclude"))


def _links(raw: object, where: str) -> tuple[tuple[str, str], ...]:
    """`{libcuda.so: libcuda.so.1, gbm/nvidia-drm_gbm.so: libnvidia-allocator.so.1}`: links made when the
    target (a mounted file's name, `{driver_version}` allowed) is mounted, in its directory or below it."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of link name to target name")
    out = []
    for link, target in raw.items():
        if (not isinstance(link, str) or not isinstance(target, str) or not link or not target or "/" in target
                or link.startswith("/") or {".", ".."} & set(link.split("/")) or "" in link.split("/")):
            raise ConfigError(f"{where}: {link!r}: the target is a mounted file's name, the link a path "
                              "relative to its directory (no '..')")
        out.append((link, target))
    return tuple(out)


def _forward_compat(raw: object, where: str) -> tuple[str, str] | None:
    if raw is None:
        return None
    f = _Fields(raw, where, {"directory", "library"})
    directory, library = f.text("directory", required=True), f.text("library", required=True)
    if not directory.startswith("/") or ":" in directory or "/" in library or ":" in library:
        raise ConfigError(f"{where}: directory is an absolute path, library a file name (no ':')")
    return directory, library


def _application_profile(raw: object, where: str) -> ApplicationProfileRule | None:
    if raw is None:
        return None
    f = _Fields(raw, where, {"gpu-node", "needs"})
    node, needs = f.text("gpu-node", required=True), f.strings("needs")
    if not node.startswith("/dev/") or node.count("{minor}") != 1:
        raise ConfigError(f"{where}.gpu-node: a /dev path with {{minor}} once")
    if not needs or not all(path.startswith("/") for path in needs):
        raise ConfigError(f"{where}.needs: one or more config files' container paths (absolute)")
    return ApplicationProfileRule(node, needs)


def _channels(raw: object, match: object, where: str) -> Channels | None:
    if raw is None:
        return None
    if match:
        raise ConfigError(f"{where}: a family of channels matches no PCI function: drop `match`")
    f = _Fields(raw, where, {"directory", "prefix", "region"})
    directory = f.text("directory", required=True)
    if not directory.startswith("/dev/"):
        raise ConfigError(f"{where}.directory: a directory under /dev")
    return Channels(directory.rstrip("/"), f.text("prefix", required=True), f.text("region", required=True))


PARTITION_TYPES = ("nvidia-mig", "amd-kfd")


def _partitions(raw: object, where: str) -> PartitionRule | None:
    if raw is None:
        return None
    f = _Fields(raw, where, {"type", "source", "node", "region", "shared"})
    kind = f.text("type", required=True)
    if kind not in PARTITION_TYPES:
        raise ConfigError(f"{where}.type: {kind!r} unknown (known: {', '.join(PARTITION_TYPES)})")
    node = f.text("node", required=True)
    if "{minor}" not in node or not node.startswith("/dev/"):
        raise ConfigError(f"{where}.node: a /dev path with {{minor}}")
    return PartitionRule(kind, f.text("source", required=True), node, f.text("region", required=True),
                         f.strings("shared"))


def _config_files(raw: object, where: str) -> tuple[ConfigFile, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list")
    out = []
    for i, item in enumerate(raw):
        f = _Fields(item, f"{where}[{i}]", {"container", "host"})
        container = f.text("container", required=True)
        hosts = f.strings("host") or (container,)
        if not all(path.startswith("/") for path in (container, *hosts)):
            raise ConfigError(f"{where}[{i}]: paths must be absolute")
        out.append(ConfigFile(container, hosts))
    return tuple(out)


PROFILE_FIELDS = frozenset({
    "name", "kind", "description", "match", "priority", "group-by", "sharing", "device-nodes", "shared-nodes", "uuid",
    "driver-version", "libraries", "library-dirs", "binaries", "files", "env", "models", "vendor-name",
    "request-env", "uevents", "health", "mount-options", "driver-libraries", "links", "config-files", "partitions",
    "forward-compat", "channels", "application-profile"})


def parse_profile(data: object, source: str) -> Profile:
    f = _Fields(data, source, PROFILE_FIELDS)
    name = f.text("name", required=True)
    kind = f.text("kind", required=True)
    if problem := kind_problem(kind):
        raise ConfigError(f"{source}.kind: {problem}")
    match = _Fields(f.data.get("match", {}), f"{source}.match", {"vendor", "class", "driver"})
    uuid = _Fields(f.data.get("uuid", {}), f"{source}.uuid", {"proc-file", "key", "nvml"})
    version = _Fields(f.data.get("driver-version", {}), f"{source}.driver-version", {"proc-file", "module"})
    group_by = f.choice("group-by", "function", ("function", "slot"), "expected function or slot")
    sharing = f.choice("sharing", "exclusive", SHARING_MODES, f"expected one of {', '.join(SHARING_MODES)}")
    models = _models(f.data.get("models", {}), f"{source}.models")
    env = _env(f)
    health_flags, kernel_log = _health(f.data.get("health", {}), f"{source}.health")
    nodes = f.data.get("device-nodes", [])
    shared = f.data.get("shared-nodes", [])
    if not isinstance(nodes, list) or not isinstance(shared, list):
        raise ConfigError(f"{source}: device-nodes and shared-nodes are lists")
    return Profile(
        name=name,
        kind=kind,
        source=source,
        description=f.text("description", ""),
        vendors=match.hex_ids("vendor"),
        class_prefixes=tuple(c.lower().removeprefix("0x") for c in match.strings("class")),
        drivers=match.strings("driver"),
        priority=f.integer("priority") or 0,
        group_by=group_by,
        sharing=sharing,
        device_nodes=tuple(_node_rule(n, f"{source}.device-nodes[{i}]") for i, n in enumerate(nodes)),
        shared_nodes=tuple(_node_rule(n, f"{source}.shared-nodes[{i}]") for i, n in enumerate(shared)),
        uuid_file=uuid.text("proc-file"),
        uuid_key=uuid.text("key"),
        uuid_nvml=uuid.flag("nvml"),
        vendor_name=f.text("vendor-name", ""),
        request_env=f.strings("request-env"),
        uevents=f.strings("uevents"),
        mount_options=_mount_options(f.data.get("mount-options", {}), f"{source}.mount-options"),
        health_flags=health_flags,
        kernel_log=kernel_log,
        driver_module=version.text("module"),
        driver_version_file=version.text("proc-file"),
        libraries=f.strings("libraries"),
        driver_libraries=_driver_libraries(f.data.get("driver-libraries"), f"{source}.driver-libraries"),
        links=_links(f.data.get("links", {}), f"{source}.links"),
        config_files=_config_files(f.data.get("config-files", []), f"{source}.config-files"),
        partitions=_partitions(f.data.get("partitions"), f"{source}.partitions"),
        forward_compat=_forward_compat(f.data.get("forward-compat"), f"{source}.forward-compat"),
        channels=_channels(f.data.get("channels"), f.data.get("match"), f"{source}.channels"),
        application_profile=_application_profile(f.data.get("application-profile"),
                                                 f"{source}.application-profile"),
        library_dirs=f.strings("library-dirs"),
        binaries=f.strings("binaries"),
        files=f.strings("files"),
        env=env,
        models=models,
    )


def _models(data: object, where: str) -> tuple[tuple[int, str], ...]:
    """`models`: device id (hex) -> the model's name, sorted by id."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of device id to name")
    try:
        return tuple(sorted((int(str(k), 16), str(v)) for k, v in data.items()))
    except ValueError:
        raise ConfigError(f"{where}: keys must be hex device ids") from None


def _env(f: _Fields) -> tuple[str, ...]:
    env = f.strings("env")
    for entry in env:
        if "=" not in entry[1:]:
            raise ConfigError(f"{f.where}.env: {entry!r} is not KEY=VALUE")
    return env


def yaml_problem(path: str, err: Exception) -> str:
    """`FILE:LINE:COL: problem (context from LINE:COL)` from PyYAML's marks (0-based), in one line: how every
    YAML file devinject reads (profiles, --config) says where it is wrong."""
    from yaml import MarkedYAMLError
    from yaml.reader import ReaderError

    if isinstance(err, ReaderError):  # not text in its encoding: a byte offset, no line
        return f"{path}: byte {err.position}: {err.reason}"
    if not isinstance(err, MarkedYAMLError) or err.problem_mark is None or not err.problem:
        return f"{path}: {' '.join(str(err).split())}"
    mark, where = err.problem_mark, err.context_mark
    text = f"{path}:{mark.line + 1}:{mark.column + 1}: {err.problem}"
    if err.context and where is not None:
        text += f" ({err.context} from {where.line + 1}:{where.column + 1})"
    return text


def _load_yaml(text: str, source: str) -> object:
    """libyaml's safe loader when there is one (the shipped profiles in 3 ms, not 17: every `generate`, agent
    start and first booking loads them); a file it refuses is read again by PyYAML's own, whose message names
    more (the alias, the token) at the same line and column."""
    import yaml

    fast = getattr(yaml, "CSafeLoader", None)
    if fast is not None:
        try:
            return yaml.load(text, Loader=fast)
        except yaml.YAMLError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(yaml_problem(source, err)) from None


def builtin_profiles() -> list[Profile]:
    out = []
    for entry in sorted(resources.files("devinject").joinpath("data/profiles").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out.append(parse_profile(_load_yaml(entry.read_text(), f"profiles/{entry.name}"), entry.name))
    return out


def load_profiles(host: Host, extra_dirs: tuple[str, ...] = ()) -> list[Profile]:
    """Shipped profiles, then admin files (same name replaces), ordered by priority then name."""
    by_name = {p.name: p for p in builtin_profiles()}
    for directory in profile_search_path(host.root, extra_dirs):
        path = Path(directory)
        if not path.is_dir():
            continue
        try:
            files = sorted(path.iterdir())
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the profile directory: {err.strerror}") from None
        for file in files:
            if file.suffix in (".yaml", ".yml"):
                try:
                    text = file.read_text()
                except OSError as err:
                    raise ConfigError(f"{file}: cannot read: {err.strerror}") from None
                profile = parse_profile(_load_yaml(text, str(file)), str(file))
                by_name[profile.name] = profile
    return sorted(by_name.values(), key=lambda p: (-p.priority, p.name))


def select_profile(profiles: list[Profile], pci: PciDevice) -> Profile | None:
    return next((p for p in profiles if p.matches(pci)), None)


def glob_names(names: tuple[str, ...], candidate: str) -> bool:
    return any(fnmatch.fnmatchcase(candidate, pattern) for pattern in names)
