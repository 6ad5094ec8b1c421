"""CDI specs as the hook sees them: every spec dir scanned, later dirs win, names resolved all-or-nothing.

Parsed specs are cached as JSON under the state dir, keyed by each file's size and mtime, so a container
start does not pay for a YAML parser.
"""

from __future__ import annotations

import os

from devinject import jsonlite
from devinject.errors import ResolveError, SpecError
from devinject.model import ContainerEdits, Spec
from devinject.names import parse_qualified_name
from devinject.spec import parse_text, spec_from_dict, spec_to_dict

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.records import NamedTuple


DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
MAX_SPEC_BYTES = 16 << 20


class Resolved(NamedTuple):
    names: tuple[str, ...]
    edits: ContainerEdits
    specs: tuple[Spec, ...]
    devices: tuple[tuple[str, ContainerEdits], ...] = ()  # each requested name with its own edits


def _spec_files(spec_dirs: tuple[str, ...]) -> list[str]:
    files = []
    for directory in spec_dirs:
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        except OSError as err:
            raise SpecError(f"{directory}: cannot list spec dir: {err.strerror}") from None
        files += [os.path.join(directory, n) for n in names if n.endswith((".yaml", ".json"))]
    return files


def _load(path: str, cache: dict[str, object] | None) -> Spec:
    try:
        st = os.stat(path)
    except OSError as err:
        raise SpecError(f"{path}: cannot read: {err.strerror}") from None
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    if cache is not None and key in cache:
        return spec_from_dict(cache[key])
    if st.st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    try:
        spec = spec_from_dict(parse_text(text, path))
    except SpecError as err:
        raise SpecError(err.message if err.message.startswith(path) else f"{path}: {err.message}") from None
    if cache is not None:
        cache[key] = spec_to_dict(spec)
    return spec


class _Entry(NamedTuple):
    spec: Spec
    edits: ContainerEdits
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
        if self.cache_file is None:
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
            os.makedirs(os.path.dirname(self.cache_file), mode=0o700, exist_ok=True)
            jsonlite.replace_file(self.cache_file, kept)
        except OSError:
            pass  # a cache is an optimisation only

    def _index(self) -> dict[str, _Entry]:
        """Every device by qualified name. As in CDI, a device in a later spec dir wins over the same
        device in an earlier one; the same device twice within one dir is a conflict and is not offered."""
        if self._devices is None:
            cache = self._read_cache()
            before = dict(cache) if cache is not None else None
            devices: dict[str, _Entry] = {}
            used: set[str] = set()
            for path in _spec_files(self.spec_dirs):
                priority = self._priority(path)
                try:
                    spec = _load(path, cache)
                except SpecError as err:
                    self.problems.append(err.message)
                    continue
                if cache is not None:
                    used |= {k for k in cache if k.startswith(path + ":")}
                for device in spec.devices:
                    qualified = f"{spec.kind}={device.name}"
                    previous = devices.get(qualified)
                    if previous is not None and previous.priority == priority:
                        self.conflicts[qualified] = f"defined in both {previous.path} and {path}"
                    elif previous is None or previous.priority < priority:
                        devices[qualified] = _Entry(spec, device.edits, priority, path)
            for qualified in self.conflicts:
                devices.pop(qualified, None)
            if cache is not None and (cache != before or set(cache) != used):
                self._write_cache(cache, used)
            self._devices = devices
        return self._devices

    def _priority(self, path: str) -> int:
        directory = os.path.dirname(path)
        return max(i for i, d in enumerate(self.spec_dirs) if os.path.normpath(d) == os.path.normpath(directory))

    def resolve(self, names: tuple[str, ...]) -> Resolved:
        """Spec-level edits once per spec, then each device's edits; any unknown name fails before anything."""
        devices = self._index()
        edits = ContainerEdits()
        used: list[Spec] = []
        device_edits: list[tuple[str, ContainerEdits]] = []
        for text in names:
            name = parse_qualified_name(text)
            entry = devices.get(str(name))
            if entry is None:
                raise ResolveError(self._unresolvable(text, name.kind))
            if entry.spec not in used:
                used.append(entry.spec)
            device_edits.append((text, entry.edits))
        for spec in used:
            edits = edits.merge(spec.edits)
        for _, item in device_edits:
            edits = edits.merge(item)
        return Resolved(names, edits, tuple(used), tuple(device_edits))

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

