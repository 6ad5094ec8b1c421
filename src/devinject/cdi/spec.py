"""CDI spec (de)serialisation: the only module that knows CDI's camelCase field names.

`spec_from_dict` is strict, like CDI's own `yaml.UnmarshalStrict`: an unknown field or a wrong type is an
error that names the field's path (`devices[3].containerEdits.deviceNodes[0].major`).
"""

from __future__ import annotations

import os

from devinject.cdi.model import ContainerEdits, Device, DeviceNode, Hook, IntelRdt, Mount, NetDevice, Spec
from devinject.core import jsonlite
from devinject.core.errors import SpecError

TYPE_CHECKING = False  # pathlib, typing and collections cost the hook ms per container start: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any

GENERATION_MARKER = "# devinject-generation: "


# --- to dict -----------------------------------------------------------------------------------------


def _node_to_dict(node: DeviceNode) -> dict[str, Any]:
    out: dict[str, Any] = {"path": node.path}
    for key, value in (
        ("hostPath", node.host_path),
        ("type", node.type),
        ("major", node.major),
        ("minor", node.minor),
        ("fileMode", node.file_mode),
        ("permissions", node.permissions),
        ("uid", node.uid),
        ("gid", node.gid),
    ):
        if value is not None:
            out[key] = value
    return out


def _mount_to_dict(mount: Mount) -> dict[str, Any]:
    out: dict[str, Any] = {"hostPath": mount.host_path, "containerPath": mount.container_path}
    if mount.options:
        out["options"] = list(mount.options)
    if mount.type:
        out["type"] = mount.type
    return out


def _hook_to_dict(hook: Hook) -> dict[str, Any]:
    out: dict[str, Any] = {"hookName": hook.hook_name, "path": hook.path}
    if hook.args:
        out["args"] = list(hook.args)
    if hook.env:
        out["env"] = list(hook.env)
    if hook.timeout is not None:
        out["timeout"] = hook.timeout
    return out


_RDT_FIELDS = (("closID", "clos_id"), ("l3CacheSchema", "l3_cache_schema"), ("memBwSchema", "mem_bw_schema"),
               ("enableCMT", "enable_cmt"), ("enableMBM", "enable_mbm"), ("schemata", "schemata"),
               ("enableMonitoring", "enable_monitoring"))


def edits_to_dict(edits: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if edits.env:
        out["env"] = list(edits.env)
    if edits.device_nodes:
        out["deviceNodes"] = [_node_to_dict(n) for n in edits.device_nodes]
    if edits.mounts:
        out["mounts"] = [_mount_to_dict(m) for m in edits.mounts]
    if edits.hooks:
        out["hooks"] = [_hook_to_dict(h) for h in edits.hooks]
    if edits.net_devices:
        out["netDevices"] = [{"hostInterfaceName": d.host_interface_name, "name": d.name} for d in edits.net_devices]
    if edits.additional_gids:
        out["additionalGids"] = list(edits.additional_gids)
    if edits.intel_rdt is not None:
        rdt = {key: getattr(edits.intel_rdt, attr) for key, attr in _RDT_FIELDS
               if getattr(edits.intel_rdt, attr) is not None}
        out["intelRdt"] = {k: list(v) if isinstance(v, tuple) else v for k, v in rdt.items()}
    return out


def spec_to_dict(spec: Spec) -> dict[str, Any]:
    out: dict[str, Any] = {"cdiVersion": spec.cdi_version, "kind": spec.kind}
    if spec.annotations:
        out["annotations"] = dict(spec.annotations)
    devices = []
    for device in spec.devices:
        item: dict[str, Any] = {"name": device.name}
        if device.annotations:
            item["annotations"] = dict(device.annotations)
        item["containerEdits"] = edits_to_dict(device.edits)
        devices.append(item)
    out["devices"] = devices
    if not spec.edits.is_empty():
        out["containerEdits"] = edits_to_dict(spec.edits)
    return out


# --- from dict ---------------------------------------------------------------------------------------


def what_it_is(value: object) -> str:
    """A value's kind in words, for messages (never Python's `None` or type names)."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "a number"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "something else"


class _Reader:
    """Typed field access on a mapping that reports the path of whatever is wrong."""

    def __init__(self, data: object, where: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(data, dict):
            raise SpecError(f"{where or 'spec'}: expected a mapping, got {what_it_is(data)}")
        self.data = data
        self.where = where
        for key in data:
            if key not in allowed:
                raise SpecError(f"{self.at(str(key))}: unknown field (known here: {', '.join(allowed)})")

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, typ: type | tuple[type, ...], *, required: bool = False) -> Any:
        if key not in self.data or self.data[key] is None:
            if required:
                raise SpecError(f"{self.at(key)}: required field missing")
            return None
        value = self.data[key]
        if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
            raise SpecError(f"{self.at(key)}: expected {_type_name(typ)}, got {what_it_is(value)}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        items = self.get(key, list) or []
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise SpecError(f"{self.at(key)}[{i}]: expected a string, got {what_it_is(item)}")
        return tuple(items)

    def integers(self, key: str) -> tuple[int, ...]:
        items = self.get(key, list) or []
        for i, item in enumerate(items):
            if not isinstance(item, int) or isinstance(item, bool):
                raise SpecError(f"{self.at(key)}[{i}]: expected a number, got {what_it_is(item)}")
        return tuple(items)

    def annotations(self, key: str) -> tuple[tuple[str, str], ...]:
        items = self.get(key, dict) or {}
        for name, value in items.items():
            if not isinstance(value, str):
                raise SpecError(f"{self.at(key)}.{name}: expected a string, got {what_it_is(value)}")
        return tuple((str(k), v) for k, v in items.items())

    def items(self, key: str, parse: Callable[[object, str], Any]) -> tuple[Any, ...]:
        return tuple(parse(item, f"{self.at(key)}[{i}]") for i, item in enumerate(self.get(key, list) or []))


def _type_name(typ: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "a number", list: "a list", dict: "a mapping",
             bool: "true or false"}
    if isinstance(typ, tuple):
        return " or ".join(names.get(t, t.__name__) for t in typ)
    return names.get(typ, typ.__name__)


def _node_from(data: object, where: str) -> DeviceNode:
    r = _Reader(data, where, ("path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"))
    return DeviceNode(
        path=r.get("path", str, required=True),
        host_path=r.get("hostPath", str),
        type=r.get("type", str),
        major=r.get("major", int),
        minor=r.get("minor", int),
        file_mode=r.get("fileMode", int),
        permissions=r.get("permissions", str),
        uid=r.get("uid", int),
        gid=r.get("gid", int),
    )


def _mount_from(data: object, where: str) -> Mount:
    r = _Reader(data, where, ("hostPath", "containerPath", "options", "type"))
    return Mount(
        host_path=r.get("hostPath", str, required=True),
        container_path=r.get("containerPath", str, required=True),
        options=r.strings("options"),
        type=r.get("type", str),
    )


def _hook_from(data: object, where: str) -> Hook:
    r = _Reader(data, where, ("hookName", "path", "args", "env", "timeout"))
    return Hook(
        hook_name=r.get("hookName", str, required=True),
        path=r.get("path", str, required=True),
        args=r.strings("args"),
        env=r.strings("env"),
        timeout=r.get("timeout", int),
    )


def _net_device_from(data: object, where: str) -> NetDevice:
    r = _Reader(data, where, ("hostInterfaceName", "name"))
    return NetDevice(r.get("hostInterfaceName", str, required=True), r.get("name", str, required=True))


def _intel_rdt_from(data: object, where: str) -> IntelRdt:
    r = _Reader(data, where, tuple(key for key, _ in _RDT_FIELDS))
    schemata = r.strings("schemata") if r.get("schemata", list) is not None else None
    return IntelRdt(r.get("closID", str), r.get("l3CacheSchema", str), r.get("memBwSchema", str),
                    r.get("enableCMT", bool), r.get("enableMBM", bool), schemata, r.get("enableMonitoring", bool))


def edits_from_dict(data: object, where: str) -> ContainerEdits:
    r = _Reader(data, where, ("env", "deviceNodes", "mounts", "hooks", "netDevices", "additionalGids", "intelRdt"))
    rdt = r.get("intelRdt", dict)
    return ContainerEdits(
        env=r.strings("env"),
        device_nodes=r.items("deviceNodes", _node_from),
        mounts=r.items("mounts", _mount_from),
        hooks=r.items("hooks", _hook_from),
        net_devices=r.items("netDevices", _net_device_from),
        additional_gids=r.integers("additionalGids"),
        intel_rdt=_intel_rdt_from(rdt, r.at("intelRdt")) if rdt is not None else None,
    )


def device_from_dict(data: object, where: str) -> Device:
    r = _Reader(data, where, ("name", "annotations", "containerEdits"))
    edits = r.get("containerEdits", dict)  # an empty `containerEdits:` is no edits (checked later)
    return Device(name=r.get("name", str, required=True),
                  edits=edits_from_dict(edits, r.at("containerEdits")) if edits is not None else ContainerEdits(),
                  annotations=r.annotations("annotations"))


def spec_from_dict(data: object) -> Spec:
    """The spec's shape: fields, types, nesting (as CDI's strict unmarshal). Values are checked by
    specrules.spec_problems."""
    r = _Reader(data, "", ("cdiVersion", "kind", "annotations", "devices", "containerEdits"))
    edits = r.get("containerEdits", dict)  # an empty `containerEdits:` is the same as none
    r.get("devices", list, required=True)
    return Spec(
        cdi_version=r.get("cdiVersion", str, required=True),
        kind=r.get("kind", str, required=True),
        devices=r.items("devices", device_from_dict),
        edits=edits_from_dict(edits, "containerEdits") if edits is not None else ContainerEdits(),
        annotations=r.annotations("annotations"),
    )


# --- files -------------------------------------------------------------------------------------------


def dump(spec: Spec, fmt: str = "yaml", *, generation: int | None = None) -> str:
    """Serialise deterministically: same spec, same bytes."""
    data = spec_to_dict(spec)
    if fmt == "json":
        import json  # pretty-printing needs the full module; generate only

        return json.dumps(data, indent=2) + "\n"
    import yaml

    header = f"---\n{GENERATION_MARKER}{generation}\n" if generation is not None else "---\n"
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml when present: same text, faster
    return header + yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=False, width=1000)


def parse_text(text: str, source: str) -> object:
    """Parse YAML or JSON text (JSON is YAML; the JSON fast path keeps the hook quick)."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            return jsonlite.loads(text)
        except ValueError as err:
            raise SpecError(f"{source}: invalid JSON: {err}") from None
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        docs = [d for d in yaml.load_all(text, Loader=loader) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError(f"{source}: invalid YAML: {' '.join(str(err).split())}") from None
    if len(docs) != 1:
        raise SpecError(f"{source}: expected one YAML document, found {len(docs)}")
    return docs[0]


def read_generation(text: str) -> int | None:
    for line in text.splitlines()[:3]:
        if line.startswith(GENERATION_MARKER):
            try:
                return int(line[len(GENERATION_MARKER) :])
            except ValueError:
                return None
    return None


MAX_SPEC_BYTES = 16 << 20
MAX_SPEC_NODES = 1_000_000  # mappings, lists and scalars after YAML aliases are expanded
SPEC_SUFFIXES = (".yaml", ".json")


def trust_problem(st: os.stat_result, *, directory: bool = False) -> str | None:
    """Why a spec file (or its directory) cannot be trusted: specs are code that runs as root, so only root
    (or the user running devinject, for a non-root `validate`) may be able to change them."""
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}, not root"
    # A sticky directory (like /tmp) lets others add files, which fail the owner check, but not replace ours.
    if st.st_mode & 0o022 and not (directory and st.st_mode & 0o1000):
        return "writable by group or others"
    return None


def spec_dir_problem(directory: str) -> str | None:
    """trust_problem for a spec directory, as a message naming it; None when it is trusted or absent."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    problem = trust_problem(st, directory=True)
    return f"{directory}: spec directory {problem}; its spec files are refused" if problem else None


def list_spec_files(directory: str) -> list[str]:
    """`*.yaml`/`*.json` regular files in a spec dir, sorted (not recursive, as CDI scans). Anything else —
    a FIFO, a socket, a directory — is skipped, never opened."""
    out = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(SPEC_SUFFIXES) and entry.is_file():
                out.append(os.path.join(directory, entry.name))
    return sorted(out)


def read_spec_text(path: str | Path, st: os.stat_result | None = None) -> str:
    """A spec file's text, only if it can be trusted. Opened non-blocking (a FIFO swapped in cannot hang
    the caller) and checked on the open fd (a name swapped after a check is caught)."""
    text_path = str(path)
    try:
        fd = os.open(text_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise SpecError(f"{text_path}: cannot read: {err.strerror}") from None
    try:
        opened = os.fstat(fd)
        if st is not None and (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise SpecError(f"{text_path}: replaced while it was being read; refused")
        if not (opened.st_mode & 0o170000) == 0o100000:
            raise SpecError(f"{text_path}: not a regular file; refused")
        problem = trust_problem(opened)
        if problem:
            raise SpecError(f"{text_path}: spec file {problem}; refused (specs run as root)")
        if opened.st_size > MAX_SPEC_BYTES:
            raise SpecError(f"{text_path}: larger than {MAX_SPEC_BYTES} bytes")
        data = os.read(fd, MAX_SPEC_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(f"{text_path}: larger than {MAX_SPEC_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"{text_path}: cannot read: not UTF-8 ({err.reason} at byte {err.start})") from None


def expanded_size(data: object, limit: int = MAX_SPEC_NODES) -> int:
    """Nodes in `data` once YAML aliases are expanded (shared objects counted each time they appear),
    computed in one pass over the distinct objects; stops counting past `limit`."""
    sizes: dict[int, int] = {}

    def size(node: object) -> int:
        if isinstance(node, dict):
            children: object = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            return 1
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = limit + 1  # a cycle (an alias to its own ancestor) is unbounded
        total = 1
        for child in children:  # type: ignore[attr-defined]
            total = min(total + size(child), limit + 1)
        sizes[id(node)] = total
        return total

    return size(data)


def parse_spec_document(text: str, source: str) -> object:
    """parse_text, refusing documents that alias their way to more than MAX_SPEC_NODES nodes."""
    data = parse_text(text, source)
    try:
        too_big = expanded_size(data) > MAX_SPEC_NODES
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply; refused") from None
    if too_big:
        raise SpecError(f"{source}: expands to more than {MAX_SPEC_NODES} nodes (YAML aliases); refused")
    return data


def load_text(text: str, source: str) -> Spec:
    """Parse and check one spec file's text (shape, then values, as CDI loads a spec); errors name `source`."""
    from devinject.cdi.specrules import spec_problems

    data = parse_spec_document(text, source)
    try:
        spec = spec_from_dict(data)
    except SpecError as err:
        if err.message.startswith(source):
            raise
        raise SpecError(f"{source}: {err.message}") from None
    problems = spec_problems(spec)
    if problems:
        more = f" (and {len(problems) - 1} more: devinject validate {source})" if len(problems) > 1 else ""
        raise SpecError(f"{source}: {problems[0]}{more}")
    return spec


def load_file(path: str | Path) -> Spec:
    return load_text(read_spec_text(path), str(path))


def write_atomic(path: Path, content: str, *, mode: int = 0o644) -> bool:
    """Write through a temp file, fsync, rename (core.atomicfile). Returns False when already identical."""
    from devinject.core.atomicfile import replace

    try:
        with open(path, encoding="utf-8") as handle:
            if handle.read() == content:
                return False
    except (OSError, UnicodeDecodeError):
        pass
    try:
        replace(str(path), content.encode(), mode, sync=True)
    except OSError as err:
        raise SpecError(f"{path}: cannot write spec: {err.strerror}") from None
    return True
