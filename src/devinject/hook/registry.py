"""CDI specs as the hook sees them: every spec dir scanned, later dirs win, names resolved all-or-nothing.

Parsed specs are cached as JSON under the state dir, keyed by each file's path and identity (device,
inode, size, mtime and ctime: a spec edited in place with its size and mtime put back is a new one), so a
container start does not pay for a YAML parser; the index reads only kinds and device names from it, and
only the spec-level edits and the devices asked for are decoded. Every file's trust is checked on every
start.
"""

from __future__ import annotations

import os

from devinject.cdi.identity import file_identity, qualified
from devinject.cdi.model import ContainerEdits
from devinject.cdi.names import parse_qualified_name
from devinject.cdi.spec import (
    device_from_dict,
    edits_from_dict,
    list_spec_files,
    load_text,
    read_spec_text,
    spec_dir_problem,
    spec_to_dict,
    trust_problem,
)
from devinject.core import jsonlite
from devinject.core.errors import DevinjectError, ResolveError, SpecError
from devinject.core.paths import DEFAULT_SPEC_DIRS
from devinject.linux.trusteddir import trusted_dir

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import Any, NamedTuple
else:
    from devinject.core.records import NamedTuple




class Resolved(NamedTuple):
    names: tuple[str, ...]
    edits: ContainerEdits
    devices: tuple[tuple[str, ContainerEdits], ...] = ()  # each requested name with its own edits


def _indexable(raw: object) -> bool:
    """A cached spec dict with the kind and device names the index reads (anything else is re-parsed)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        return False
    devices = raw.get("devices")
    return isinstance(devices, list) and all(isinstance(d, dict) and isinstance(d.get("name"), str)
                                             for d in devices)


def _load(path: str, cache: dict[str, object] | None) -> tuple[dict[str, Any], str, bool]:
    """One spec file as a checked spec dict, its cache key, and whether it had to be parsed. The file's trust
    is checked on every load; its parse comes from the cache while its identity is unchanged."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise SpecError(f"{path}: cannot read: {err.strerror}") from None
    problem = trust_problem(st)
    if problem:
        raise SpecError(f"{path}: spec file {problem}; refused (specs run as root)")
    key = f"{path}:{file_identity(st)}"
    cached = cache.get(key) if cache is not None else None
    if _indexable(cached):
        return cached, key, False  # type: ignore[return-value]
    raw = spec_to_dict(load_text(read_spec_text(path, st), path))
    if cache is not None:
        cache[key] = raw
    return raw, key, True


class _Entry(NamedTuple):
    raw: dict[str, Any]  # the spec, as a dict: its parts decoded only when one of its devices is asked for
    position: int  # the device's place in the spec
    priority: int
    path: str


class Registry:
    def __init__(self, spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS, cache_file: str | None = None) -> None:
        self.spec_dirs = spec_dirs
        self.cache_file = cache_file
        self._devices: dict[str, _Entry] | None = None
        self.problems: list[str] = []  # spec files that could not be loaded (they block nobody else)
        self.conflicts: dict[str, str] = {}

    def _read_cache(self) -> dict[str, object] | None:
        """The cached parses; None (no cache this time) when there is none or its directory is not root's
        alone: a parse read from there runs as root."""
        if self.cache_file is None:
            return None
        try:
            trusted_dir(os.path.dirname(self.cache_file) or ".")
        except DevinjectError:
            return None
        try:
            with open(self.cache_file, encoding="utf-8") as handle:
                data = jsonlite.loads(handle.read())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_cache(self, cache: dict[str, object], used: set[str]) -> None:
        if self.cache_file is None:
            return
        kept = {k: v for k, v in cache.items() if k in used}
        try:
            jsonlite.replace_file(self.cache_file, kept)  # into the directory _read_cache checked
        except OSError:
            pass  # a cache is an optimisation only

    def _index(self) -> dict[str, _Entry]:
        """Every device by qualified name. As in CDI, a device in a later spec dir wins over the same
        device in an earlier one; the same device twice within one dir is a conflict and is not offered."""
        if self._devices is None:
            cache = self._read_cache()
            devices: dict[str, _Entry] = {}
            used: set[str] = set()
            parsed = False
            for path in self._spec_files():
                priority = self._priority(path)
                try:
                    raw, key, fresh = _load(path, cache)
                except SpecError as err:
                    self.problems.append(err.message)
                    continue
                used.add(key)
                parsed |= fresh
                kind = raw["kind"]
                for index, device in enumerate(raw["devices"]):
                    name = qualified(kind, device["name"])
                    previous = devices.get(name)
                    if previous is not None and previous.priority == priority:
                        self.conflicts[name] = f"defined in both {previous.path} and {path}"
                    elif previous is None or previous.priority < priority:
                        devices[name] = _Entry(raw, index, priority, path)
            for conflicted in self.conflicts:
                devices.pop(conflicted, None)
            if cache is not None and (parsed or len(cache) != len(used)):
                self._write_cache(cache, used)
            self._devices = devices
        return self._devices

    def _spec_files(self) -> list[str]:
        files = []
        for directory in self.spec_dirs:
            try:
                names = list_spec_files(directory)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise SpecError(f"{directory}: cannot list spec dir: {err.strerror}") from None
            problem = spec_dir_problem(directory)
            if problem:
                self.problems.append(problem)
                continue
            files += names
        return files

    def _priority(self, path: str) -> int:
        directory = os.path.dirname(path)
        return max(i for i, d in enumerate(self.spec_dirs) if os.path.normpath(d) == os.path.normpath(directory))

    def resolve(self, names: tuple[str, ...]) -> Resolved:
        """Spec-level edits once per spec, then each device's edits; any unknown name fails before anything.
        Only what is asked for is decoded from the (already checked) spec dicts, not every device of a spec."""
        devices = self._index()
        spec_edits: dict[str, ContainerEdits] = {}  # by file, in first-use order
        device_edits: list[tuple[str, ContainerEdits]] = []
        for text in names:
            name = parse_qualified_name(text)
            entry = devices.get(str(name))
            if entry is None:
                raise ResolveError(self._unresolvable(text, name.kind))
            if entry.path not in spec_edits:
                level = entry.raw.get("containerEdits")
                spec_edits[entry.path] = edits_from_dict(level, "containerEdits") if level else ContainerEdits()
            device = device_from_dict(entry.raw["devices"][entry.position], f"devices[{entry.position}]")
            device_edits.append((text, device.edits))
        edits = ContainerEdits()
        for level_edits in spec_edits.values():
            edits = edits.merge(level_edits)
        for _, item in device_edits:
            edits = edits.merge(item)
        return Resolved(names, edits, tuple(device_edits))

    def offered(self) -> dict[str, str]:
        """Every name a runtime reading these dirs resolves -> the spec file it comes from (the later dir's,
        as CDI reads them); the conflicted names are in `conflicts`, unreadable files in `problems`."""
        return {name: entry.path for name, entry in sorted(self._index().items())}

    @staticmethod
    def _node_paths(entry: _Entry) -> list[str]:
        device = entry.raw["devices"][entry.position]
        edits = device.get("containerEdits") if isinstance(device, dict) else None
        nodes = edits.get("deviceNodes") if isinstance(edits, dict) else None
        paths = []
        for node in nodes if isinstance(nodes, list) else ():
            path = node.get("hostPath") or node.get("path") if isinstance(node, dict) else None
            if isinstance(path, str):
                paths.append(path)
        return paths

    def partition_parents(self, kind: str) -> set[str]:
        """Host paths of nodes that devices of `kind` with different node sets share (besides `all`): the
        parent GPU every MIG device of it lists. Several containers may hold such a node at once; names of one
        device (index and UUID) list the same set and share nothing."""
        seen: dict[str, set[frozenset[str]]] = {}
        for name, entry in self._index().items():
            owner, _, device = name.partition("=")
            if owner != kind or device == "all":
                continue
            paths = frozenset(self._node_paths(entry))
            for path in paths:
                seen.setdefault(path, set()).add(paths)
        return {path for path, sets in seen.items() if len(sets) > 1}

    def node_kinds(self) -> dict[str, set[str]]:
        """Host path of every device node a spec's device offers -> the kinds offering it (from the cached
        spec dicts: nothing is parsed). A bundle's nodes are then booked as the kinds they come from."""
        kinds: dict[str, set[str]] = {}
        for entry in self._index().values():
            for path in self._node_paths(entry):
                kinds.setdefault(path, set()).add(entry.raw["kind"])
        return kinds

    def _unresolvable(self, text: str, kind: str) -> str:
        if text in self.conflicts:
            return f"unresolvable CDI device {text}: {self.conflicts[text]} (same priority)"
        offered = [q.partition("=")[2] for q in (self._devices or {}) if q.partition("=")[0] == kind]
        if offered:
            return f"unresolvable CDI device {text}: {kind} offers {', '.join(offered)}"
        kinds = ", ".join(sorted({q.partition("=")[0] for q in self._devices or {}})) or "none"
        broken = f"; unreadable spec: {self.problems[0]}" if self.problems else ""
        return (f"unresolvable CDI device {text}: no spec for kind {kind} "
                f"(kinds: {kinds}; spec dirs: {', '.join(self.spec_dirs)}{broken})")

