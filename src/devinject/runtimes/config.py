"""Each container runtime's own configuration, as CDI needs it: read (does it apply CDI, from which dirs, does
it pass pod annotations through) and changed (`devinject runtime configure`: turn CDI on and set the spec
dirs, idempotently, keeping an admin's settings and comments; `--revert` takes the change back).

Where the change goes, per runtime:
- containerd 2.x: a drop-in, `<config dir>/conf.d/99-devinject.toml`, of the root config's own version (2, 3
  or 4: 2.3.0-2.3.4 refuse to start on a newer drop-in) and that version's table
  (`[plugins."io.containerd.cri.v1.runtime"]`, or for 2 `[plugins."io.containerd.grpc.v1.cri"]`, which
  containerd 2 migrates), named in the main config's `imports` unless an entry covers it (Go's glob rules);
  containerd 2 merges an imported plugin table key by key.
- containerd 1.7: the main config itself, `[plugins."io.containerd.grpc.v1.cri"]` `enable_cdi` and
  `cdi_spec_dirs`, edited line by line. An import is no use there: containerd 1.x replaces a whole plugin
  table with an imported one, so a drop-in with the two keys would drop every other CRI setting (the
  sandbox image, the runtimes, the CNI dirs). Each line devinject changes carries a comment with what it was.
- containerd 1.6 and older, runc: no CDI; the OCI hook applies the specs there (`devinject install-hook`).
- CRI-O: `<its --config-dir>/99-devinject.conf` (/etc/crio/crio.conf.d whatever --config says),
  `[crio.runtime] cdi_spec_dirs` (CRI-O applies CDI whenever the spec dirs hold specs).
- docker ≥ 25: `daemon.json`, only what its version needs (runtimes/docker.py), with a record of the change.
- podman: `<config dir>/containers.conf.d/99-devinject.conf`, `[engine] cdi_spec_dirs`.

Every file is parsed before anything is written (a malformed one is one line naming it), values are written by
tomli-w, the edited text is parsed again and must differ from the old only in the keys devinject owns, and the
merged result must apply the change (a later drop-in overriding it is named). A symbolic-linked file is written
through to its checked target. Paths are the runtime's, read and written under a host root.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from typing import Any

from devinject.core.errors import ConfigError
from devinject.core.paths import DEFAULT_SPEC_DIRS
from devinject.runtimes.names import CONFIGURABLE

# the plan's types and the version helpers live in plan.py (docker.py shares them); named here as before
from devinject.runtimes.plan import CRIO_CONFIG_DIR as CRIO_CONFIG_DIR
from devinject.runtimes.plan import DEFAULT_CONFIG as DEFAULT_CONFIG
from devinject.runtimes.plan import NO_CDI_FIX as NO_CDI_FIX
from devinject.runtimes.plan import Change as Change
from devinject.runtimes.plan import Plan as Plan
from devinject.runtimes.plan import binary_version as binary_version
from devinject.runtimes.plan import in_root as in_root
from devinject.runtimes.plan import major_minor

_major_minor = major_minor

DROP_IN = "99-devinject"
MARK = "# devinject runtime configure"
CRI_17 = "io.containerd.grpc.v1.cri"
CRI_2 = "io.containerd.cri.v1.runtime"


# ---- reading ----------------------------------------------------------------------------------------------

def read_text(path: str) -> str | None:
    """A config file's text; None when it is not there. Anything else unreadable is one line naming it."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8"
        raise ConfigError(f"{path}: cannot read: {why}") from None


def parse_toml(text: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}; nothing written") from None


def parse_json(text: str, path: str) -> dict[str, Any]:
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}; nothing written") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object; nothing written")
    return data


def _table(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        value = data.get(key)
        data = value if isinstance(value, dict) else {}
    return data


def go_glob(pattern: str, root: str = "/") -> list[str]:
    """The paths `pattern` matches as Go's filepath.Glob finds them (containerd's `imports`): `*` and `?`
    never match `/`, `[...]` negated by `^`, dot files matched like any; each directory's names sorted. The
    pattern and the paths are as the runtime sees them, read under `root`. A bad pattern matches nothing."""
    parts = [p for p in pattern.split("/") if p]
    found = ["/"] if pattern.startswith("/") else [""]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        regex = _go_pattern(part)
        step: list[str] = []
        for base in found:
            if regex is None:  # no meta: the name itself
                candidate = os.path.join(base, part)
                if os.path.lexists(in_root(root, candidate)) if last else os.path.isdir(in_root(root, candidate)):
                    step.append(candidate)
                continue
            try:
                names = sorted(os.listdir(in_root(root, base or ".")))
            except OSError:
                continue
            step.extend(os.path.join(base, name) for name in names if regex.fullmatch(name)
                        and (last or os.path.isdir(in_root(root, os.path.join(base, name)))))
        found = step
    return found


def _go_pattern(part: str) -> re.Pattern[str] | None:
    """One path component of a Go filepath.Match pattern as a regex; None when it has no meta character."""
    if not any(c in part for c in "*?[\\"):
        return None
    out, i = [], 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "\\" and i + 1 < len(part):
            i += 1
            out.append(re.escape(part[i]))
        elif c == "[":
            close = part.find("]", i + 2 if part[i + 1:i + 2] in ("^", "]") else i + 1)
            if close < 0:
                return re.compile(r"(?!)")  # Go: ErrBadPattern, which Glob reports as no match here
            body = part[i + 1:close]
            negate = body.startswith("^")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\").replace("[", "\\[") + "]")
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def resolve_imports(parent: str, imports: list[Any], root: str = "/", planned: list[str] | None = None) -> list[str]:
    """A config file's `imports` as containerd 2 resolves them (server/config.resolveImports): cleaned, a
    relative one joined to the parent file's directory, globbed (Go's rules) only when it holds a `*`.
    `planned`: files not written yet that a glob would find once they are."""
    out: list[str] = []
    for entry in imports:
        if not isinstance(entry, str) or not entry:
            continue
        path = os.path.normpath(entry)
        if not os.path.isabs(path):
            path = os.path.join(os.path.dirname(parent), path)
        if "*" in path:
            found = set(go_glob(path, root)) | {p for p in planned or [] if import_covers(parent, entry, p)}
            out.extend(sorted(found))
        else:
            out.append(path)
    return out


@dataclass(frozen=True, slots=True)
class ContainerdConfig:
    """containerd's config as it reads it: the root file, then each import merged key by key (containerd 2;
    1.x replaces a plugin table, which the merge does not model: the CDI keys read the same either way when
    the import holds the whole table)."""

    data: dict[str, Any]
    files: tuple[str, ...]  # the files read, as the runtime names them
    version: int | None  # the root file's `version` (1 when it has none); None: no root file
    newer: tuple[tuple[str, int], ...] = ()  # imports whose version is above the root's (2.3.0-2.3.4 refuse them)

    def cri(self, two: bool) -> tuple[bool, list[str], str | None]:
        """(enable_cdi, cdi_spec_dirs, the last file that set either) for containerd 2.x (`two`: CDI on by
        default) or 1.7 (off by default). The spec dirs default to CDI's own."""
        section = _table(self.data, "plugins", CRI_2 if (self.version or 0) >= 3 else CRI_17)
        enabled = section.get("enable_cdi", two) is True
        dirs = section.get("cdi_spec_dirs")
        return (enabled, [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else list(DEFAULT_SPEC_DIRS),
                self.setter)

    @property
    def setter(self) -> str | None:
        setter = self.data.get(_SETTER)
        return setter if isinstance(setter, str) else None


_SETTER = "\0devinject: the file that last set a CDI key"  # no TOML key can hold a NUL


def containerd_config(main: str) -> tuple[dict[str, Any], list[str]]:
    """The merged config of the root file `main` on this machine and the files read (install-hook's view)."""
    found = read_containerd(main)
    return found.data, list(found.files)


def read_containerd(main: str, root: str = "/", texts: dict[str, str | None] | None = None) -> ContainerdConfig:
    """containerd's config from the root file `main` (as the runtime names it) and its imports, read under
    `root` as containerd 2 reads them (breadth first, each file once). `texts`: files' texts to use instead of
    reading them (a planned change; None: the file is gone)."""
    def text_of(path: str) -> str | None:
        return texts[path] if texts is not None and path in texts else read_text(in_root(root, path))

    text = text_of(main)
    if text is None:
        return ContainerdConfig({}, (), None)
    data: dict[str, Any] = {}
    files: list[str] = []
    newer: list[tuple[str, int]] = []
    version: int | None = None
    pending, loaded = [main], set()
    while pending:
        path, pending = pending[0], pending[1:]
        if path in loaded:
            continue
        loaded.add(path)
        current = text if path == main else text_of(path)
        if current is None:
            continue  # containerd fails on a missing literal import; the doctor names what it read
        parsed = parse_toml(current, in_root(root, path))
        file_version = parsed.get("version", 1)
        if version is None:
            version = file_version if isinstance(file_version, int) else 1
        elif isinstance(file_version, int) and file_version > version:
            newer.append((path, file_version))
        if _table(parsed, "plugins", CRI_2).keys() & {"enable_cdi", "cdi_spec_dirs"} or \
                _table(parsed, "plugins", CRI_17).keys() & {"enable_cdi", "cdi_spec_dirs"}:
            data[_SETTER] = path
        data = _merge(data, {k: v for k, v in parsed.items() if k != "version"})
        files.append(path)
        planned = [p for p, planned_text in (texts or {}).items() if planned_text is not None]
        pending.extend(resolve_imports(path, parsed.get("imports") or [], root, planned))
    data["version"] = version
    return ContainerdConfig(data, tuple(files), version, tuple(newer))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def containerd_cri(data: dict[str, Any], two: bool | None = None) -> tuple[bool, list[str]]:
    """(enable_cdi, cdi_spec_dirs) of a merged config: 2.x's runtime plugin (CDI on by default there), else
    1.7's CRI plugin (off by default); `two` None: 2.x when the config is version 3 or later."""
    found = data.get("version")
    version = found if isinstance(found, int) else 1
    enabled, dirs, _ = ContainerdConfig(data, (), version).cri(version >= 3 if two is None else two)
    return enabled, dirs


def annotations_passed_through(data: dict[str, Any]) -> list[str]:
    """The containerd runtimes whose `pod_annotations` let a pod's `cdi.k8s.io/*` annotations through to the OCI
    spec, where they look like the kubelet's (the devinject hook serves a pod's containers only what the node's
    agents granted the pod; a hook or runtime trusting annotations would let a pod user pick devices the
    scheduler never gave it). Each as `runtime: pattern`."""
    version = data.get("version")
    section = _table(data, "plugins", CRI_2 if isinstance(version, int) and version >= 3 else CRI_17)
    runtimes = _table(section, "containerd", "runtimes")
    found = []
    for name, runtime in sorted(runtimes.items()):
        patterns = runtime.get("pod_annotations") if isinstance(runtime, dict) else None
        for pattern in patterns if isinstance(patterns, list) else []:
            if isinstance(pattern, str) and (fnmatch.fnmatchcase("cdi.k8s.io/devinject_gpu", pattern)
                                             or pattern.startswith("cdi.k8s.io")):
                found.append(f"{name}: {pattern}")
    return found


# ---- changing: TOML line edits ----------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?$")


def _header_key(line: str) -> str | None:
    """A table header's key, normalised (`plugins."io.containerd.grpc.v1.cri"`); None for another line.
    Array-of-tables headers (`[[...]]`) are tables too for where a table ends."""
    match = _HEADER.match(line.replace("[[", "[").replace("]]", "]"))
    if not match:
        return None
    return re.sub(r"\s*\.\s*", ".", match.group(1)).replace("'", '"')


def _toml_value(value: object) -> str:
    """`value` as one line of TOML, each scalar written by tomli-w (json.dumps writes a character outside the
    BMP as a surrogate pair's escapes, which TOML rejects)."""
    import tomli_w

    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def _toml_document(path: str, comment: str, data: dict[str, Any]) -> str:
    """A whole file devinject owns: its comment line, then `data` written by tomli-w and read back."""
    import tomli_w

    text = f"{MARK}: {comment}\n" + tomli_w.dumps(data)
    if _parsed_back(path, text) != data:
        raise ConfigError(f"{path}: the text devinject would write does not read back as written; nothing written")
    return text


def _parsed_back(path: str, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: the edited text is not valid TOML ({err}); nothing written") from None


def _key_span(lines: list[str], start: int, end: int, key: str) -> tuple[int, int] | None:
    """Lines [first, last) of `key = ...` between `start` and `end` (a multi-line array to its `]`)."""
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start, end):
        if pattern.match(lines[i]):
            depth, j = 0, i
            while j < end:
                code = lines[j].split("#", 1)[0]
                depth += code.count("[") - code.count("]")
                j += 1
                if depth <= 0:
                    break
            return i, j
    return None


def _table_span(lines: list[str], header: str) -> tuple[int, int] | None:
    """Lines [header, next header) of the table `header`."""
    for i, line in enumerate(lines):
        if _header_key(line) == header:
            end = next((j for j in range(i + 1, len(lines)) if _header_key(lines[j]) is not None), len(lines))
            return i, end
    return None


def _set_keys(text: str, header: str | None, values: dict[str, object]) -> str:
    """`text` with each key of `values` set in table `header` (None: the top level), each changed line marked
    with what it was; a missing table is appended, marked."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    if header is None:
        span: tuple[int, int] | None = (0, next((i for i, line in enumerate(lines) if _header_key(line)), len(lines)))
    else:
        span = _table_span(lines, header)
    if span is None:
        block = [f"\n[{header}]  {MARK}\n"] + [f"  {k} = {_toml_value(v)}\n" for k, v in values.items()]
        return "".join(lines + block)
    start, end = span
    for key, value in values.items():
        line = f"{key} = {_toml_value(value)}"
        found = _key_span(lines, start + (header is not None), end, key)
        if found is None:
            at = start + 1 if header is not None else _top_insert_at(lines, end)
            indent = re.match(r"\s*", lines[start]).group(0) + "  " if header is not None else ""  # type: ignore[union-attr]
            lines.insert(at, f"{indent}{line}  {MARK} (added)\n")
            end += 1
            continue
        first, last = found
        old = " ".join(part.split("#", 1)[0].strip() for part in lines[first:last]).strip()
        if old.replace(" ", "") == line.replace(" ", ""):
            continue
        indent = re.match(r"\s*", lines[first]).group(0)  # type: ignore[union-attr]
        original = "".join(lines[first:last])
        # a one-line plain setting reads back as it was; anything else (a comment, several lines) is kept whole
        was = f"(was: {old})" if original == f"{indent}{old}\n" else f"(was verbatim: {json.dumps(original)})"
        lines[first:last] = [f"{indent}{line}  {MARK} {was}\n"]
        end -= last - first - 1
    return "".join(lines)


def _top_insert_at(lines: list[str], end: int) -> int:
    """Where a new top-level key goes: after `version = N` when there is one, else after the leading comments."""
    for i in range(end):
        if re.match(r"^\s*version\s*=", lines[i]):
            return i + 1
    i = 0
    while i < end and (lines[i].startswith("#") or not lines[i].strip()):
        i += 1
    return i


def _unmark(text: str) -> str:
    """`text` with every line devinject marked taken back: the old line restored, an added one dropped, an
    appended table removed with its keys."""
    out: list[str] = []
    dropping = False
    for line in text.splitlines(keepends=True):
        if _header_key(line) is not None:
            dropping = MARK in line
            if dropping:
                while out and not out[-1].strip():
                    out.pop()
                continue
        if dropping:
            continue
        if MARK not in line:
            out.append(line)
            continue
        verbatim = re.search(re.escape(MARK) + r" \(was verbatim: (\".*\")\)\s*$", line)
        if verbatim:
            out.append(json.loads(verbatim.group(1)))
            continue
        was = re.search(re.escape(MARK) + r" \(was: (.*)\)\s*$", line)
        if was:
            indent = re.match(r"\s*", line).group(0)  # type: ignore[union-attr]
            out.append(f"{indent}{was.group(1)}\n")
    return "".join(out)


def _without(data: dict[str, Any], path: tuple[str, ...], keys: tuple[str, ...]) -> dict[str, Any]:
    """`data` with `keys` of the table at `path` removed (an emptied table removed too), for comparing."""
    if not path:
        return {k: v for k, v in data.items() if k not in keys}
    head, rest = path[0], path[1:]
    if not isinstance(data.get(head), dict):
        return data
    inner = _without(data[head], rest, keys)
    out = dict(data)
    if inner:
        out[head] = inner
    else:
        out.pop(head)
    return out


def _check_edit(path: str, old: str, new: str, table: tuple[str, ...], keys: tuple[str, ...]) -> None:
    """The edited text parses and differs from the old only in `keys` of `table`: no admin setting lost."""
    before, after = parse_toml(old, path) if old.strip() else {}, _parsed_back(path, new)
    if _without(before, table, keys) != _without(after, table, keys):
        raise ConfigError(f"{path}: cannot set {', '.join(keys)} in this file's layout without changing other "
                          "settings; nothing written (set them by hand)")


# ---- plans per runtime ------------------------------------------------------------------------------------

def plan_configure(runtime: str, *, config: str | None = None, spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS,
                   version: str | None = None, revert: bool = False, root: str = "/",
                   config_dir: str | None = None) -> Plan:
    """The changes that turn CDI on for `runtime` (or, `revert`, take devinject's change back). Reads only.
    `config` and `config_dir` (CRI-O's drop-in dir) as the runtime names them, on the host under `root`."""
    if runtime not in CONFIGURABLE:
        raise ConfigError(f"{runtime} applies no CDI itself: {NO_CDI_FIX}")
    if root == "/":  # the running runtime's own paths and version, where not given
        config, config_dir, version = _running_defaults(runtime, config, config_dir, version)
    dirs = list(spec_dirs)
    if runtime == "containerd":
        return _containerd(root, config or DEFAULT_CONFIG[runtime], dirs, version, revert)
    path = write_target(root, config or DEFAULT_CONFIG[runtime])
    if runtime == "docker":
        return _docker(path, dirs, version, revert)
    section, subdir = {"crio": (("crio", "runtime"), config_dir or CRIO_CONFIG_DIR),
                       "podman": (("engine",), os.path.join(os.path.dirname(config or DEFAULT_CONFIG[runtime]),
                                                            "containers.conf.d"))}[runtime]
    drop_in = os.path.join(subdir, DROP_IN + ".conf")
    real = write_target(root, drop_in)
    existing = read_text(real)
    suffix = DROP_IN_SUFFIX[runtime]
    layers = toml_layers(root, config or DEFAULT_CONFIG[runtime], subdir, suffix=suffix)
    restart = {"crio": "systemctl restart crio", "podman": "podman reads it at its next command"}[runtime]
    if revert:
        return _plan(runtime, [Change(real, existing, None)], restart)
    if _table(layers.data, *section).get("cdi_spec_dirs") == dirs:
        return _plan(runtime, [], restart)
    data: dict[str, Any] = {}
    _table_at(data, section)["cdi_spec_dirs"] = dirs
    new = _toml_document(real, f"CDI spec dirs ({runtime} applies CDI from them); `devinject runtime configure "
                         f"--runtime {runtime} --revert` removes this file", data)
    after = toml_layers(root, config or DEFAULT_CONFIG[runtime], subdir, {drop_in: new}, suffix)
    if _table(after.data, *section).get("cdi_spec_dirs") != dirs:
        raise ConfigError(f"{after.setter}: sets cdi_spec_dirs after {drop_in} ({runtime} reads its drop-ins in "
                          "name order); nothing written (change it there)")
    return _plan(runtime, [Change(real, existing, new)], restart)


def _running_defaults(runtime: str, config: str | None, config_dir: str | None,
                      version: str | None) -> tuple[str | None, str | None, str | None]:
    """What the running CRI-O or containerd (root's, on this machine) reads, for what was not given: CRI-O's
    --config and --config-dir; containerd's --config, and its binary's version when that config is the one
    configured (the containerd on PATH may be another)."""
    from devinject.runtimes import daemons

    if runtime == "crio" and (config is None or config_dir is None):
        crio = daemons.running_crio()
        if crio is not None:
            return config or crio[1][0], config_dir or crio[1][1], version
    if runtime == "containerd" and version is None:
        containerd = daemons.running_containerd()
        if containerd is not None and (config is None or os.path.abspath(config) == containerd[1]):
            return containerd[1], config_dir, containerd[2]
    return config, config_dir, version


DROP_IN_SUFFIX = {"crio": "", "podman": ".conf"}  # CRI-O reads every file there (1.36.3's `crio config`), podman *.conf


@dataclass(frozen=True, slots=True)
class Layers:
    """A main TOML config and its drop-ins merged as CRI-O and podman read them (name order, later wins key by
    key); `setter`: the last file that set cdi_spec_dirs."""

    data: dict[str, Any]
    files: tuple[str, ...]
    setter: str | None


def toml_layers(root: str, main: str, drop_in_dir: str, texts: dict[str, str] | None = None,
                suffix: str = "") -> Layers:
    """The main file and the drop-ins in `drop_in_dir` (as the runtime names them, read under `root`);
    `texts`: a planned drop-in's text, as if it were there."""
    planned = dict(texts or {})
    names = {os.path.join(drop_in_dir, name) for name in _listdir(in_root(root, drop_in_dir))
             if name.endswith(suffix) and os.path.isfile(in_root(root, os.path.join(drop_in_dir, name)))}
    names |= set(planned)
    data: dict[str, Any] = {}
    files: list[str] = []
    setter = None
    for path in [main, *sorted(names)]:
        text = planned[path] if path in planned else read_text(in_root(root, path))
        if text is None:
            continue
        parsed = parse_toml(text, in_root(root, path))
        if any("cdi_spec_dirs" in _table(parsed, *section) for section in (("crio", "runtime"), ("engine",))):
            setter = path
        data = _merge(data, parsed)
        files.append(path)
    return Layers(data, tuple(files), setter)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _table_at(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    for key in keys:
        data = data.setdefault(key, {})
    return data


def write_target(root: str, path: str) -> str:
    """The file to read and write for `path` (as the runtime names it) under `root`: itself, or where its
    symbolic links lead (an absolute link resolved under `root`), so the admin's managed target is written
    through, never replaced by a regular file. A link's target must be a regular file owned by root (or this
    user) and writable by nobody else, inside the root; else one line, nothing written."""
    real = in_root(root, path)
    first = real
    for _ in range(40):
        if not os.path.islink(real):
            break
        target = os.readlink(real)
        real = os.path.normpath(in_root(root, target) if os.path.isabs(target)
                                else os.path.join(os.path.dirname(real), target))
    else:
        raise ConfigError(f"{first}: too many levels of symbolic links; nothing written")
    if real == first:
        return real
    why = None
    if root != "/" and not real.startswith(root.rstrip("/") + "/"):
        why = f"leads out of {root}"
    else:
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            why = "leads to nothing"
        except OSError as err:
            why = f"cannot be checked ({err.strerror})"
        else:
            if not stat.S_ISREG(st.st_mode):
                why = "is not a regular file"
            elif st.st_uid not in (0, os.geteuid()):
                why = f"is owned by uid {st.st_uid}, not root"
            elif st.st_mode & 0o022:
                why = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        raise ConfigError(f"{first}: a symbolic link to {real}, which {why}; nothing written")
    return real


def _plan(runtime: str, changes: list[Change], restart: str) -> Plan:
    real = tuple(c for c in changes if c.old != c.new)
    return Plan(runtime, real, (f"then: {restart}",) if real else ())


NEWEST_CONFIG = 4  # containerd 2.3's `config default`


def containerd_version_problem(file_version: int | None, known: str) -> str | None:
    """Why containerd `known` would refuse a root config of `file_version` (None: no file), or None."""
    major_minor = _major_minor(known)
    if file_version is None or file_version == 2:
        return None
    if file_version == 1:
        return ("a version 1 config (no `version`), which devinject does not edit: "
                + ("migrate it (containerd config migrate)" if major_minor >= (2, 0) else
                   "make it version 2 (version = 2, plugins.cri named plugins.\"io.containerd.grpc.v1.cri\")"))
    if file_version > NEWEST_CONFIG or file_version < 1:
        return f"version {file_version}, which no containerd devinject knows reads (2.3 reads up to {NEWEST_CONFIG})"
    if major_minor < (2, 0):
        return f"a version {file_version} config (containerd 2's), which containerd {known} does not read"
    if file_version == 4 and major_minor < (2, 3):
        return f"a version 4 config (containerd 2.3's), which containerd {known} does not read (up to 3)"
    return None


def _containerd(root: str, path: str, dirs: list[str], version: str | None, revert: bool) -> Plan:
    real = write_target(root, path)
    text = read_text(real)
    current = read_containerd(path, root, {path: text})
    major_minor = _containerd_version(root, real, version, current.version)
    two = major_minor >= (2, 0)
    restart = "systemctl restart containerd"
    drop_in = os.path.join(os.path.dirname(path), "conf.d", DROP_IN + ".toml")
    drop_real = write_target(root, drop_in)
    existing = read_text(drop_real)
    if existing is not None:
        parse_toml(existing, drop_real)
    if revert:
        changes = [Change(drop_real, existing, None)] if two or existing is not None else []
        if text is not None:
            changes.append(Change(real, text, _unmark(text)))
        return _plan("containerd", changes, restart)
    enabled, now, _ = current.cri(two)
    if enabled and now == dirs:
        return _plan("containerd", [], restart)  # in effect already (2.x without a config: CDI's default dirs)
    if not two:
        old = text if text is not None else "version = 2\n"
        new = _set_keys(old, f'plugins."{CRI_17}"', {"enable_cdi": True, "cdi_spec_dirs": dirs})
        _check_edit(real, old, new, ("plugins", CRI_17), ("enable_cdi", "cdi_spec_dirs"))
        return _plan("containerd", [Change(real, text, new)], restart)
    # never a drop-in newer than the root file: 2.3.0-2.3.4 refuse to start then
    drop_version = current.version or (4 if major_minor >= (2, 3) else 3)
    changes = _containerd_drop_in(root, path, dirs, drop_version, real=real, text=text, drop_in=drop_in,
                                  drop_real=drop_real, existing=existing)
    return _plan("containerd", changes, restart)


def _containerd_version(root: str, real: str, version: str | None, file_version: int | None) -> tuple[int, int]:
    """The (major, minor) of the containerd the config is for: --runtime-version, else the binary's on /, else
    what the file's own version says; refused where it applies no CDI or does not read that file."""
    known = version or (binary_version("containerd") if root == "/" else None)
    if known is None:
        if file_version is None:
            raise ConfigError(f"{real}: no config and no containerd binary to tell its version: "
                              "give --runtime-version 1.7 or 2.x")
        known = {3: "2.0", 4: "2.3"}.get(file_version, "1.7")  # a version 2 config edited in place: 1.7 and 2.x
    major_minor = _major_minor(known)
    if major_minor < (1, 7):
        raise ConfigError(f"containerd {known} applies no CDI (enable_cdi came in 1.7): {NO_CDI_FIX}")
    problem = containerd_version_problem(file_version, known)
    if problem:
        raise ConfigError(f"{real}: {problem}; nothing written")
    return major_minor


def _containerd_drop_in(root: str, path: str, dirs: list[str], drop_version: int, *, real: str, text: str | None,
                        drop_in: str, drop_real: str, existing: str | None) -> list[Change]:
    """containerd 2's changes: devinject's drop-in with CDI on and `dirs`, imported by the root config; refused
    where a later import would set the keys back."""
    section = CRI_17 if drop_version == 2 else CRI_2  # a version 2 file's CRI keys, which containerd 2 migrates
    drop_text = _toml_document(drop_real, "CDI on, spec dirs; `devinject runtime configure --runtime containerd "
                               "--revert` removes this file",
                               {"version": drop_version, "plugins": {section: {"enable_cdi": True,
                                                                               "cdi_spec_dirs": dirs}}})
    changes = [Change(drop_real, existing, drop_text)]
    imports = (tomllib.loads(text).get("imports") if text is not None else None) or []
    main_text = text
    if not any(import_covers(path, entry, drop_in) for entry in imports):
        old = text if text is not None else f"version = {drop_version}\n"
        main_text = _set_keys(old, None, {"imports": [*imports, drop_in]})
        _check_edit(real, old, main_text, (), ("imports",))
        changes.append(Change(real, text, main_text))
    enabled, now, setter = read_containerd(path, root, {path: main_text, drop_in: drop_text}).cri(True)
    if not enabled or now != dirs:
        raise ConfigError(f"{in_root(root, setter or path)}: sets {'enable_cdi' if not enabled else 'cdi_spec_dirs'}"
                          f" after {drop_in} (containerd merges its imports in order); nothing written (change it "
                          "there)")
    return changes


def import_covers(parent: str, entry: object, path: str) -> bool:
    """Whether the `imports` entry of the config `parent` names `path` (which need not exist yet), as
    containerd resolves it: relative to the parent's directory, Go's glob rules when it holds a `*`."""
    if not isinstance(entry, str) or not entry:
        return False
    pattern = os.path.normpath(entry)
    if not os.path.isabs(pattern):
        pattern = os.path.join(os.path.dirname(parent), pattern)
    if "*" not in pattern:
        return pattern == os.path.normpath(path)
    parts, names = pattern.split("/"), os.path.normpath(path).split("/")
    if len(parts) != len(names):
        return False
    for part, name in zip(parts, names, strict=True):
        regex = _go_pattern(part)
        if not (regex.fullmatch(name) if regex is not None else part == name):
            return False
    return True


def _docker(path: str, dirs: list[str], version: str | None, revert: bool) -> Plan:
    from devinject.runtimes import docker

    return docker.configure(path, dirs, version=version, revert=revert)


def apply(plan: Plan) -> list[str]:
    """Write (atomically) or remove each changed file; the lines saying what was done. A runtime's config is
    code it runs as root: each is written through linux/trusteddir (directories made 0755 whatever the
    umask, every directory on the way and the file already there checked as root's alone)."""
    from devinject.linux.trusteddir import remove_file, write_file

    done = []
    for change in plan.changes:
        if change.new is None:
            if change.old is not None and remove_file(change.path, what="runtime config", error=ConfigError):
                done.append(f"removed {change.path}")
            continue
        write_file(change.path, change.new.encode(), None, what="runtime config", error=ConfigError, sync=True)
        done.append(f"wrote {change.path}")
    return done
