"""Each container runtime's own configuration, as CDI needs it: read (does it apply CDI, from which dirs, does
it pass pod annotations through) and changed (`devinject runtime configure`: turn CDI on and set the spec
dirs, idempotently, keeping an admin's settings and comments; `--revert` takes the change back).

Where the change goes, per runtime:
- containerd 2.x: a drop-in, `<config dir>/conf.d/99-devinject.toml` (`version = 3`,
  `[plugins."io.containerd.cri.v1.runtime"]`), named in the main config's `imports`; containerd 2 merges an
  imported plugin table key by key.
- containerd 1.7: the main config itself, `[plugins."io.containerd.grpc.v1.cri"]` `enable_cdi` and
  `cdi_spec_dirs`, edited line by line. An import is no use there: containerd 1.x replaces a whole plugin
  table with an imported one, so a drop-in with the two keys would drop every other CRI setting (the
  sandbox image, the runtimes, the CNI dirs). Each line devinject changes carries a comment with what it was.
- containerd 1.6 and older, runc: no CDI; the OCI hook applies the specs there (`devinject install-hook`).
- CRI-O: `<config dir>/crio.conf.d/99-devinject.conf`, `[crio.runtime] cdi_spec_dirs` (CRI-O applies CDI
  whenever the spec dirs hold specs).
- docker ≥ 25: `daemon.json`, only what its version needs (runtimes/docker.py), with a record of the change.
- podman: `<config dir>/containers.conf.d/99-devinject.conf`, `[engine] cdi_spec_dirs`.

Every file is parsed before anything is written (a malformed one is one line naming it), the edited text is
parsed again and must differ from the old only in the keys devinject owns, and each write is atomic.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import tomllib
from typing import Any

from devinject.core.errors import ConfigError
from devinject.core.paths import DEFAULT_SPEC_DIRS

# the plan's types and the version helpers live in plan.py (docker.py shares them); named here as before
from devinject.runtimes.plan import NO_CDI_FIX as NO_CDI_FIX
from devinject.runtimes.plan import Change as Change
from devinject.runtimes.plan import Plan as Plan
from devinject.runtimes.plan import binary_version as binary_version
from devinject.runtimes.plan import major_minor

_major_minor = major_minor

RUNTIMES = ("containerd", "crio", "docker", "podman", "runc")
CONFIGURABLE = ("containerd", "crio", "docker", "podman")
DEFAULT_CONFIG = {
    "containerd": "/etc/containerd/config.toml",
    "crio": "/etc/crio/crio.conf",
    "docker": "/etc/docker/daemon.json",
    "podman": "/etc/containers/containers.conf",
}
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


def containerd_config(main: str) -> tuple[dict[str, Any], list[str]]:
    """containerd's config as it reads it: the main file, then each import (containerd 2 merges them key by key;
    1.x replaces a plugin table, which `_merge` does not model: the CDI keys read the same either way when the
    import holds the whole table). The files read, for the doctor to name."""
    text = read_text(main)
    if text is None:
        return {}, []
    data = parse_toml(text, main)
    files = [main]
    for pattern in data.get("imports") or []:
        if not isinstance(pattern, str):
            continue
        pattern = pattern if os.path.isabs(pattern) else os.path.join(os.path.dirname(main), pattern)
        import glob

        for path in sorted(glob.glob(pattern)):
            imported = read_text(path)
            if imported is not None:
                data = _merge(data, parse_toml(imported, path))
                files.append(path)
    return data, files


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def containerd_cri(data: dict[str, Any]) -> tuple[bool, list[str]]:
    """(enable_cdi, cdi_spec_dirs) as containerd reads them: 2.x's runtime plugin (CDI on by default there),
    else 1.7's CRI plugin (off by default). The spec dirs default to CDI's own."""
    if data.get("version") == 3:
        section = _table(data, "plugins", CRI_2)
        enabled = section.get("enable_cdi", True) is True
    else:
        section = _table(data, "plugins", CRI_17)
        enabled = section.get("enable_cdi", False) is True
    dirs = section.get("cdi_spec_dirs")
    return enabled, [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else list(DEFAULT_SPEC_DIRS)


def annotations_passed_through(data: dict[str, Any]) -> list[str]:
    """The containerd runtimes whose `pod_annotations` let a pod's `cdi.k8s.io/*` annotations through to the OCI
    spec, where they look like the kubelet's (the devinject hook serves a pod's containers only what the node's
    agents granted the pod; a hook or runtime trusting annotations would let a pod user pick devices the
    scheduler never gave it). Each as `runtime: pattern`."""
    section = _table(data, "plugins", CRI_2 if data.get("version") == 3 else CRI_17)
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
    return json.dumps(value)  # a TOML basic string / array of them / bool reads the same


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
        lines[first:last] = [f"{indent}{line}  {MARK} (was: {old})\n"]
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
    before, after = parse_toml(old, path) if old.strip() else {}, tomllib.loads(new)
    if _without(before, table, keys) != _without(after, table, keys):
        raise ConfigError(f"{path}: cannot set {', '.join(keys)} in this file's layout without changing other "
                          "settings; nothing written (set them by hand)")


# ---- plans per runtime ------------------------------------------------------------------------------------

def plan_configure(runtime: str, *, config: str | None = None, spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS,
                   version: str | None = None, revert: bool = False) -> Plan:
    """The changes that turn CDI on for `runtime` (or, `revert`, take devinject's change back). Reads only."""
    if runtime not in CONFIGURABLE:
        raise ConfigError(f"{runtime} applies no CDI itself: {NO_CDI_FIX}")
    path = config or DEFAULT_CONFIG[runtime]
    dirs = list(spec_dirs)
    if runtime == "containerd":
        return _containerd(path, dirs, version, revert)
    if runtime == "docker":
        return _docker(path, dirs, version, revert)
    section, key, subdir = {"crio": ("crio.runtime", "cdi_spec_dirs", "crio.conf.d"),
                            "podman": ("engine", "cdi_spec_dirs", "containers.conf.d")}[runtime]
    main = read_text(path)
    if main is not None:
        parse_toml(main, path)
    drop_in = os.path.join(os.path.dirname(path), subdir, DROP_IN + ".conf")
    existing = read_text(drop_in)
    if existing is not None:
        parse_toml(existing, drop_in)
    new = None if revert else (f"{MARK}: CDI spec dirs ({runtime} applies CDI from them); "
                               f"`devinject runtime configure --runtime {runtime} --revert` removes this file\n"
                               f"[{section}]\n{key} = {_toml_value(dirs)}\n")
    restart = {"crio": "systemctl restart crio", "podman": "podman reads it at its next command"}[runtime]
    return _plan(runtime, [Change(drop_in, existing, new)], restart)


def _plan(runtime: str, changes: list[Change], restart: str) -> Plan:
    real = tuple(c for c in changes if c.old != c.new)
    return Plan(runtime, real, (f"then: {restart}",) if real else ())


def _containerd(path: str, dirs: list[str], version: str | None, revert: bool) -> Plan:
    text = read_text(path)
    data = parse_toml(text, path) if text is not None else {}
    if data and data.get("version") not in (2, 3):
        raise ConfigError(f"{path}: a version {data.get('version', 1)} config; migrate it first "
                          "(containerd config migrate) or give --runtime-version; nothing written")
    known = version or ("2.0" if data.get("version") == 3 else binary_version("containerd"))
    if known is None:
        if text is None:
            raise ConfigError(f"{path}: no config and no containerd binary to tell its version: "
                              "give --runtime-version 1.7 or 2.0")
        known = "1.7"  # a version 2 config and no binary to ask: 1.7's keys
    major_minor = _major_minor(known)
    if major_minor < (1, 7):
        raise ConfigError(f"containerd {known} applies no CDI (enable_cdi came in 1.7): {NO_CDI_FIX}")
    restart = "systemctl restart containerd"
    if major_minor < (2, 0):
        if revert:
            return _plan("containerd", [Change(path, text, _unmark(text))] if text is not None else [], restart)
        old = text if text is not None else "version = 2\n"
        new = _set_keys(old, f'plugins."{CRI_17}"', {"enable_cdi": True, "cdi_spec_dirs": dirs})
        _check_edit(path, old, new, ("plugins", CRI_17), ("enable_cdi", "cdi_spec_dirs"))
        return _plan("containerd", [Change(path, text, new)], restart)
    drop_in = os.path.join(os.path.dirname(path), "conf.d", DROP_IN + ".toml")
    existing = read_text(drop_in)
    if existing is not None:
        parse_toml(existing, drop_in)
    imports = [p for p in data.get("imports") or [] if isinstance(p, str)]
    covered = any(fnmatch.fnmatchcase(drop_in, p) for p in imports)
    if revert:
        changes = [Change(drop_in, existing, None)]
        if text is not None:
            changes.append(Change(path, text, _unmark(text)))
        return _plan("containerd", changes, restart)
    changes = [Change(drop_in, existing,
                      f"{MARK}: CDI on, spec dirs; `devinject runtime configure --runtime containerd --revert` "
                      f"removes this file\nversion = 3\n\n[plugins.\"{CRI_2}\"]\n  enable_cdi = true\n"
                      f"  cdi_spec_dirs = {_toml_value(dirs)}\n")]
    if not covered:
        old = text if text is not None else "version = 3\n"
        new = _set_keys(old, None, {"imports": [*imports, drop_in]})
        _check_edit(path, old, new, (), ("imports",))
        changes.append(Change(path, text, new))
    return _plan("containerd", changes, restart)


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
