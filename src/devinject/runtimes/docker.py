"""docker's side of CDI: what dockerd reads (daemon.json, its own command line, its systemd unit) and the
smallest daemon.json change that makes it apply devinject's specs (`devinject runtime configure --runtime
docker`), with a record of that change so `--revert` takes back exactly it.

What docker does, by version (moby; checked on dockerd 29.7.2 with `dockerd --validate` and `docker info`):
- < 25: no CDI, and daemon.json's unknown keys stop it from starting: nothing is written, the hook applies specs.
- 25 to 28.1: CDI only with `"features": {"cdi": true}`.
- 28.2 and later: CDI on by default (moby 4cecce03f6); `"features": {"cdi": false}` turns it off.
- The spec dirs: `cdi-spec-dirs`, else /etc/cdi and /var/run/cdi; an empty list reads none.
- A key that a flag also sets (`--cdi-spec-dir` and `cdi-spec-dirs`, any `--feature` and `features`) stops
  dockerd from starting ("specified both as a flag and in the configuration file").
- A UTF-8 BOM before the JSON is accepted.

The record (`daemon.json.devinject` beside the file, JSON) holds what the file was before devinject's first
change (its text, or that it was absent), the SHA-256 of what devinject wrote last, and what devinject added
(features.cdi, which spec dirs, the default dirs it filled in when it created `cdi-spec-dirs`). `--revert`
puts the old bytes back when the file is still as devinject left it, and otherwise takes out only what devinject
added; without a record, there is nothing of devinject's to take back.

Planning is pure (text, command lines and version in, a Plan out); reading the OS is in the functions that take
a root.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

from devinject.core.errors import ConfigError
from devinject.core.paths import DEFAULT_SPEC_DIRS
from devinject.runtimes.daemons import root_processes
from devinject.runtimes.plan import NO_CDI_FIX, Change, Plan, binary_version, in_root
from devinject.runtimes.plan import major_minor as _major_minor

DEFAULT_CONFIG = "/etc/docker/daemon.json"
DOCKER_SPEC_DIRS = DEFAULT_SPEC_DIRS  # what dockerd reads without cdi-spec-dirs: CDI's own defaults
CDI_FEATURE = (25, 0)  # features.cdi came in 25
CDI_BY_DEFAULT = (28, 2)  # moby 4cecce03f6: CDI on unless features.cdi is false
RECORD_SUFFIX = ".devinject"
RECORD_KIND = "devinject docker daemon.json record"
RESTART = "then: systemctl restart docker"
DaemonJson = dict[str, Any]  # daemon.json as parse_daemon_json reads it, its keys checked
BOM = "\ufeff"
UNIT = "docker.service"
# where systemd looks for a unit and its drop-ins, first wins for a unit file (a drop-in's name likewise)
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system",
             "/lib/systemd/system")


# ---- dockerd's command line ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DaemonFlags:
    """What a dockerd command line sets of what devinject reads or writes; `source` names where it was read."""

    source: str
    config_file: str = DEFAULT_CONFIG
    spec_dirs: tuple[str, ...] | None = None  # --cdi-spec-dir, None when not given
    features: dict[str, bool] | None = None  # --feature, None when not given
    args: tuple[str, ...] = ()  # the whole command line, for asking that dockerd to --validate a file


def parse_flags(args: list[str], source: str) -> DaemonFlags:
    """dockerd's flags (`args`: its whole command line) as pflag reads them (`--name value` or `--name=value`);
    anything else is skipped."""
    config_file = DEFAULT_CONFIG
    spec_dirs: list[str] = []
    features: dict[str, bool] = {}
    saw_dirs = saw_features = False
    i = 1
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name not in ("--config-file", "--cdi-spec-dir", "--feature"):
            continue
        if not eq:
            if i >= len(args):
                break
            value = args[i]
            i += 1
        if name == "--config-file":
            config_file = value
        elif name == "--cdi-spec-dir":
            saw_dirs = True
            spec_dirs.extend(part for part in value.split(",") if part)  # a list flag: comma-separated too
        else:
            saw_features = True
            for part in value.split(","):
                key, has, flag = part.partition("=")
                features[key.strip()] = flag.strip().lower() in ("1", "t", "true") if has else True
    return DaemonFlags(source, config_file, tuple(spec_dirs) if saw_dirs else None,
                       features if saw_features else None, tuple(args))


def exec_start(unit_texts: list[str]) -> list[str] | None:
    """The command of a unit's last ExecStart (its file's, then its drop-ins' in order; an empty ExecStart=
    resets), split as systemd splits it; None when there is none."""
    command: str | None = None
    for text in unit_texts:
        for line in re.sub(r"\\\n", " ", text).splitlines():
            key, eq, value = line.strip().partition("=")
            if eq and key.strip() == "ExecStart":
                command = value.strip() or None
    if command is None:
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if words:
        words[0] = words[0].lstrip("-@+!:")
    return words


def _same(root: str, daemon_path: str, path: str) -> bool:
    return os.path.realpath(in_root(root, daemon_path)) == os.path.realpath(path)


def _roots(path: str) -> bool:
    """`path` (a /proc/PID dir: the process's user; a unit file) is root's (or this user's, who runs devinject)
    and only theirs to change."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def running_daemons(root: str) -> list[tuple[int, DaemonFlags]]:
    """Each dockerd running as root under `root`'s /proc with its flags (its pid for asking its binary), as
    daemons.root_processes finds the node's containerd and CRI-O."""
    proc = in_root(root, "/proc")
    return [(pid, parse_flags(args, os.path.join(proc, str(pid), "cmdline")))
            for pid, args in root_processes("dockerd", proc)]


def unit_daemon(root: str) -> DaemonFlags | None:
    """dockerd's flags as its systemd unit (docker.service and its drop-ins) under `root` starts it."""
    unit = next((p for d in UNIT_DIRS if os.path.isfile(p := os.path.join(in_root(root, d), UNIT))), None)
    if unit is None or not _roots(unit):  # a unit others could write names no binary devinject may run
        return None
    drop_ins: dict[str, str] = {}
    for directory in UNIT_DIRS:
        for path in glob.glob(os.path.join(in_root(root, directory), UNIT + ".d", "*.conf")):
            if _roots(path):
                drop_ins.setdefault(os.path.basename(path), path)
    files = [unit, *(drop_ins[name] for name in sorted(drop_ins))]
    texts = []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                texts.append(handle.read(1 << 20))
        except OSError:
            continue
    words = exec_start(texts)
    if not words or os.path.basename(words[0]) != "dockerd":
        return None
    return parse_flags(words, " + ".join(files))


@dataclass(frozen=True, slots=True)
class Daemon:
    """The dockerd that reads a daemon.json: its flags as it runs now and as its unit would start it."""

    pid: int | None = None
    running: DaemonFlags | None = None
    unit: DaemonFlags | None = None
    sources: tuple[DaemonFlags, ...] = field(default=())

    @property
    def spec_dirs(self) -> tuple[tuple[str, ...], str] | None:
        """--cdi-spec-dir as the daemon runs (else as its unit starts it), with where it was read."""
        for flags in self.sources:
            if flags.spec_dirs is not None:
                return flags.spec_dirs, flags.source
        return None

    @property
    def features(self) -> tuple[dict[str, bool], str] | None:
        for flags in self.sources:
            if flags.features is not None:
                return flags.features, flags.source
        return None


def find_daemon(root: str, config: str) -> Daemon:
    """The dockerd under `root` whose --config-file is `config`: its running process and its unit."""
    running = [(pid, f) for pid, f in running_daemons(root) if _same(root, f.config_file, config)]
    unit = unit_daemon(root)
    if unit is not None and not _same(root, unit.config_file, config):
        unit = None
    pid, flags = running[0] if running else (None, None)
    return Daemon(pid, flags, unit, tuple(f for f in (flags, unit) if f is not None))


def daemon_version(root: str, daemon: Daemon) -> str | None:
    """docker's version, asked (bounded) only on the machine's own root: of the running dockerd's binary,
    else of the one on PATH."""
    if root != "/":
        return None
    if daemon.pid is not None:
        found = binary_version(f"/proc/{daemon.pid}/exe")
        if found is not None:
            return found
    return binary_version("dockerd")


# ---- daemon.json --------------------------------------------------------------------------------------------

def read_bytes_text(path: str) -> str | None:
    """The file's text exactly (no newline translation, a BOM kept); None when it is absent."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(1 << 22)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}; nothing written") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8; nothing written") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_daemon_json(text: str | None, path: str) -> dict[str, Any]:
    """daemon.json as dockerd reads it (a BOM skipped, an empty file is no settings), the keys devinject reads
    checked as dockerd types them. Anything dockerd would refuse is one line naming the file."""
    if text is None:
        return {}
    body = text.removeprefix(BOM)
    if not body.strip():
        return {}
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}; nothing written") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}; nothing written") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object; nothing written")
    features = data.get("features", {})
    if not isinstance(features, dict) or not all(isinstance(v, bool) for v in features.values()):
        raise ConfigError(f"{path}: features: expected an object of true/false (dockerd refuses anything else); "
                          "nothing written")
    dirs = data.get("cdi-spec-dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ConfigError(f"{path}: cdi-spec-dirs: expected a list of paths (dockerd refuses anything else); "
                          "nothing written")
    return data


def _indent(text: str) -> int:
    """The indent an admin's file uses (2 when it shows none)."""
    found = re.search(r"\n([ ]+)\"", text)
    return len(found.group(1)) if found else 2


def render(data: dict[str, Any], like: str | None) -> str:
    """daemon.json's text for `data`: the old file's BOM and indent kept."""
    bom = BOM if like is not None and like.startswith(BOM) else ""
    return bom + json.dumps(data, indent=_indent(like or ""), ensure_ascii=False) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the record of devinject's change --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Record:
    """What devinject changed in one daemon.json."""

    written: str  # SHA-256 of the text devinject wrote last
    before: str | None  # the text before devinject's first change
    before_known: bool  # False: the file changed by hand between two of devinject's changes (`before` unusable)
    features_cdi: bool  # devinject added features.cdi = true
    spec_dirs: tuple[str, ...]  # the dirs devinject added to cdi-spec-dirs
    filled: tuple[str, ...] | None  # cdi-spec-dirs created by devinject: the default dirs it put in first

    def to_json(self) -> str:
        return json.dumps({"kind": RECORD_KIND, "version": 1, "written_sha256": self.written,
                           "before": ({"text": self.before} if self.before is not None else {"absent": True})
                           if self.before_known else None,
                           "features_cdi": self.features_cdi, "spec_dirs": list(self.spec_dirs),
                           "filled_spec_dirs": list(self.filled) if self.filled is not None else None},
                          indent=1) + "\n"


def record_path(config: str) -> str:
    return config + RECORD_SUFFIX


def read_record(path: str) -> str | None:
    """The record's text, from a plain file that only root (or this user) can have written: its `before` is
    written back into daemon.json by --revert, and daemon.json is root's code (its runtimes run as root)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}; nothing written") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: the record of devinject's change is not a plain file; nothing written")
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise ConfigError(f"{path}: the record of devinject's change is writable by others (owner uid {st.st_uid}, "
                          f"mode {stat.S_IMODE(st.st_mode):o}): not trusted; nothing written")
    return read_bytes_text(path)


def parse_record(text: str, path: str, config: str) -> Record:
    """The record, or one line naming it (a record that cannot be read is never guessed at)."""
    corrupt = (f"{path}: corrupt record of devinject's change to {config} ({{why}}); nothing written: check "
               f"{config} by hand, then remove {path}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(corrupt.format(why=f"not JSON: {err.msg}")) from None
    if not isinstance(data, dict) or data.get("kind") != RECORD_KIND or data.get("version") != 1:
        raise ConfigError(corrupt.format(why="not a version 1 record"))
    before, written = data.get("before"), data.get("written_sha256")
    dirs, filled, cdi = data.get("spec_dirs"), data.get("filled_spec_dirs"), data.get("features_cdi")
    valid = (isinstance(written, str) and re.fullmatch(r"[0-9a-f]{64}", written) is not None
             and (before is None or (isinstance(before, dict) and (before == {"absent": True}
                                                                  or isinstance(before.get("text"), str))))
             and isinstance(cdi, bool) and isinstance(dirs, list) and all(isinstance(d, str) for d in dirs)
             and (filled is None or (isinstance(filled, list) and all(isinstance(d, str) for d in filled))))
    if not valid:
        raise ConfigError(corrupt.format(why="a field missing or of the wrong type"))
    assert isinstance(written, str) and isinstance(cdi, bool) and isinstance(dirs, list)
    return Record(written, before.get("text") if isinstance(before, dict) else None, before is not None, cdi,
                  tuple(dirs), tuple(filled) if isinstance(filled, list) else None)


# ---- planning -------------------------------------------------------------------------------------------------

def _has(dirs: list[str] | tuple[str, ...], path: str) -> bool:
    return os.path.normpath(path) in {os.path.normpath(d) for d in dirs}


def plan_configure(path: str, text: str | None, record_text: str | None, *, version: str | None,
                   daemon: Daemon, spec_dirs: list[str]) -> Plan:
    """The change to daemon.json (and its record) that makes docker `version` apply CDI from `spec_dirs`:
    nothing where it already does. Refused, one line and nothing written: a docker without CDI, an admin's
    CDI off, a key a flag of dockerd's already sets."""
    record_file = record_path(path)
    record = parse_record(record_text, record_file, path) if record_text is not None else None
    known = _configurable_version(version)
    data = parse_daemon_json(text, path)
    added_cdi = _adds_features_cdi(path, data, daemon, version, known)
    current, missing, filled = _missing_spec_dirs(path, data, daemon, spec_dirs)
    out = dict(data)
    if added_cdi:
        out["features"] = {**data.get("features", {}), "cdi": True}
    if missing:
        out["cdi-spec-dirs"] = [*current, *missing]
    if out == data:
        return Plan("docker", ())
    new = render(out, text)
    record = _next_record(record, text, new, added_cdi, missing, filled)
    return Plan("docker", (Change(record_file, record_text, record.to_json()), Change(path, text, new)), (RESTART,))


def _configurable_version(version: str | None) -> tuple[int, int]:
    """docker's version as (major, minor), refused where devinject cannot write CDI's keys for it."""
    if version is None:
        raise ConfigError("docker's version is unknown (no dockerd to ask): give --runtime-version; nothing written")
    known = _major_minor(version)
    if known < CDI_FEATURE:
        raise ConfigError(f"docker {version} applies no CDI (features.cdi came in 25) and refuses keys it does not "
                          f"know, so daemon.json is left alone: {NO_CDI_FIX}")
    return known


def _cdi_feature(data: DaemonJson, daemon: Daemon) -> bool | None:
    """features.cdi as dockerd applies it: its --feature flag's when it has one (then daemon.json's is refused)."""
    flag_features = daemon.features
    return flag_features[0].get("cdi") if flag_features is not None else data.get("features", {}).get("cdi")


def _adds_features_cdi(path: str, data: DaemonJson, daemon: Daemon, version: str | None,
                       known: tuple[int, int]) -> bool:
    """Whether daemon.json needs features.cdi: true (a docker before 28.2 with it unset); refused where an admin
    turned CDI off, or where dockerd's --feature flag owns the key."""
    flag_features = daemon.features
    if flag_features is not None and "features" in data:
        raise ConfigError(f"{path}: features is set here and by dockerd's --feature ({flag_features[1]}): dockerd "
                          "refuses to start so; keep one of them; nothing written")
    cdi = _cdi_feature(data, daemon)
    where = f"dockerd's --feature cdi=false ({flag_features[1]})" if flag_features is not None else \
        f"{path}: features.cdi is false"
    if cdi is False:
        raise ConfigError(f"{where}: CDI is turned off on purpose, and devinject does not turn it on; set it to true "
                          "by hand (or remove it, docker 28.2+) and run this again; nothing written")
    if cdi is not None or known >= CDI_BY_DEFAULT:
        return False
    if flag_features is not None:
        raise ConfigError(f"docker {version} needs features.cdi, and dockerd's command line sets --feature "
                          f"({flag_features[1]}), so daemon.json cannot (dockerd would refuse to start): add "
                          "--feature cdi=true there; nothing written")
    return True


def _missing_spec_dirs(path: str, data: DaemonJson, daemon: Daemon,
                       spec_dirs: list[str]) -> tuple[list[str], list[str], tuple[str, ...] | None]:
    """The dirs docker reads now, those of `spec_dirs` it does not, and the defaults written out with them
    (where daemon.json had no cdi-spec-dirs); refused where an admin emptied the list or a flag owns it."""
    flag_dirs = daemon.spec_dirs
    if "cdi-spec-dirs" in data and flag_dirs is not None:
        raise ConfigError(f"{path}: cdi-spec-dirs is set here and by dockerd's --cdi-spec-dir ({flag_dirs[1]}): "
                          "dockerd refuses to start so; keep one of them; nothing written")
    current: list[str] = (list(flag_dirs[0]) if flag_dirs is not None
                          else data.get("cdi-spec-dirs", list(DOCKER_SPEC_DIRS)))
    if not current and "cdi-spec-dirs" in data:
        raise ConfigError(f"{path}: cdi-spec-dirs is empty (docker reads no spec dirs: CDI off on purpose), and "
                          "devinject does not turn it on; add the dirs by hand; nothing written")
    missing = [d for d in dict.fromkeys(spec_dirs) if not _has(current, d)]
    if missing and flag_dirs is not None:
        adds = " ".join(f"--cdi-spec-dir {shlex.quote(d)}" for d in missing)
        raise ConfigError(f"dockerd's command line sets --cdi-spec-dir ({flag_dirs[1]}), so daemon.json cannot "
                          f"(dockerd would refuse to start): add {adds} there; nothing written")
    filled = DOCKER_SPEC_DIRS if missing and "cdi-spec-dirs" not in data else None
    return current, missing, filled


def _next_record(record: Record | None, text: str | None, new: str, added_cdi: bool, missing: list[str],
                 filled: tuple[str, ...] | None) -> Record:
    """The record of this change, merged into an earlier one's."""
    if record is None:
        return Record(_sha(new), text, True, added_cdi, tuple(missing), filled)
    # a second change: the first's `before` holds while the file is as devinject left it
    kept = record.before_known and text is not None and _sha(text) == record.written
    return Record(_sha(new), record.before if kept else None, kept, record.features_cdi or added_cdi,
                  (*record.spec_dirs, *missing), record.filled if record.filled is not None else filled)


def plan_revert(path: str, text: str | None, record_text: str | None) -> Plan:
    """The change that takes devinject's change to daemon.json back: the old bytes (or the file's absence) while
    the file is as devinject left it, else only what devinject added; nothing without a record."""
    if record_text is None:
        return Plan("docker", ())
    record_file = record_path(path)
    record = parse_record(record_text, record_file, path)
    drop_record = Change(record_file, record_text, None)
    if text is not None and record.before_known and _sha(text) == record.written:
        return Plan("docker", (Change(path, text, record.before), drop_record), (RESTART,))
    data = parse_daemon_json(text, path)
    out = dict(data)
    dirs = data.get("cdi-spec-dirs")
    if isinstance(dirs, list) and record.spec_dirs:
        left = [d for d in dirs if not _has(record.spec_dirs, d)]
        if record.filled is not None and left == list(record.filled):
            out.pop("cdi-spec-dirs")
        else:
            out["cdi-spec-dirs"] = left
    features = data.get("features")
    if record.features_cdi and isinstance(features, dict) and features.get("cdi") is True:
        rest = {k: v for k, v in features.items() if k != "cdi"}
        if rest:
            out["features"] = rest
        else:
            out.pop("features")
    changes = [Change(path, text, render(out, text))] if out != data else []
    return Plan("docker", (*changes, drop_record), (RESTART,) if changes else ())


def without_config_file(args: tuple[str, ...]) -> list[str]:
    """A dockerd command line without its --config-file (and any --validate)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--config-file":
            skip = True
        elif not arg.startswith("--config-file=") and arg != "--validate":
            out.append(arg)
    return out


def dockerd_refuses(root: str, daemon: Daemon, text: str, *, timeout: float = 15.0) -> str | None:
    """What the node's own dockerd says of `text` as its daemon.json (`dockerd --validate`, with the flags it
    runs with, bounded); None when it takes it, or when there is no dockerd here to ask (a root other than /,
    none running and no unit's binary) or it does not answer in time."""
    if root != "/":
        return None
    if daemon.pid is not None and daemon.running is not None:
        binary, args = f"/proc/{daemon.pid}/exe", daemon.running.args
    elif daemon.unit is not None and daemon.unit.args and os.path.isabs(daemon.unit.args[0]):
        binary, args = daemon.unit.args[0], daemon.unit.args
    else:
        return None
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".json", prefix="devinject-daemon-") as handle:
        handle.write(text)
        handle.flush()
        try:
            done = subprocess.run([binary, *without_config_file(args)[1:], "--validate", "--config-file",
                                   handle.name], capture_output=True, text=True, errors="replace", timeout=timeout,
                                  check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout)[-4096:].strip().splitlines()
    return (lines[-1] if lines else f"exit status {done.returncode}").replace(handle.name, "the file")[:500]


def write_target(path: str) -> str:
    """Where a change to `path` is written: the file itself, or, for a link, its target when that is a plain file
    root owns that others cannot write (daemon.json is root's code); anything else is one line naming it."""
    if not os.path.islink(path):
        return path
    target = os.path.realpath(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise ConfigError(f"{path}: a link to {target}, which is not there; nothing written") from None
    except OSError as err:
        raise ConfigError(f"{path}: a link to {target}: {err.strerror}; nothing written") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise ConfigError(f"{path}: a link to {target}, which is not a plain file of root's that only root can "
                          "write; nothing written")
    return target


def configure(path: str, spec_dirs: list[str], *, version: str | None, revert: bool, root: str = "/") -> Plan:
    """plan_configure / plan_revert for the daemon.json at `path`, the dockerd reading it found under `root`,
    its version asked (bounded) only on the machine's own root when not given. A daemon.json that is a link
    (config management's) is changed in its target, the record beside the target."""
    path = write_target(path)
    text = read_bytes_text(path)
    record_text = read_record(record_path(path))
    if revert:
        return plan_revert(path, text, record_text)
    daemon = find_daemon(root, path)
    plan = plan_configure(path, text, record_text, version=version or daemon_version(root, daemon), daemon=daemon,
                          spec_dirs=spec_dirs)
    new = next((c.new for c in plan.changes if c.path == path), None)
    refused = dockerd_refuses(root, daemon, new) if new is not None else None
    if refused is not None:  # dockerd's own word on the file it would start with (unknown keys: no list here)
        raise ConfigError(f"{path}: dockerd refuses it with devinject's change: {refused}; nothing written")
    return plan


# ---- what doctor reads ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DockerStatus:
    applies: bool
    detail: str
    fix: str | None = None
    spec_dirs: tuple[str, ...] | None = None
    spec_dir_fix: str | None = None  # how to add a dir docker does not read ({spec_dir} in it)


def status(path: str, text: str | None, *, version: str | None, daemon: Daemon, hook_installed: bool) -> DockerStatus:
    """Whether docker `version` applies CDI with this daemon.json and command line, from which dirs, and the fix
    that works on that version. Pure."""
    named = f"docker {version}" if version else "docker"
    known = _major_minor(version) if version else None
    if known is not None and known < CDI_FEATURE:
        if hook_installed:
            return DockerStatus(True, f"{named} applies no CDI; the devinject hook is installed")
        return DockerStatus(False, f"{named} applies no CDI (it came in 25) and the devinject hook is not installed",
                            f"{NO_CDI_FIX}; or upgrade docker to 28.2+")
    try:
        data = parse_daemon_json(text, path)
    except ConfigError as err:
        return DockerStatus(False, err.message.removesuffix("; nothing written") + " (dockerd does not start)",
                            f"correct {path} (dockerd --validate --config-file {path} says what it refuses)")
    read = path if text is not None else f"{path} absent"
    off = _cdi_off(path, data, read, daemon=daemon, version=version, known=known)
    if off is not None:
        return off
    dirs, where, dir_fix = _status_spec_dirs(path, data, read, daemon=daemon, version=version)
    on = "features.cdi" if _cdi_feature(data, daemon) else "on by default since 28.2"
    if not dirs:
        # configure leaves an admin's empty list alone (CDI off on purpose): the fix is the admin's
        return DockerStatus(False, f"{named} applies CDI ({on}) from no spec dir ({where} is empty)",
                            f"put the spec dirs into cdi-spec-dirs in {path} (or remove it for "
                            f"{', '.join(DOCKER_SPEC_DIRS)}), then systemctl restart docker")
    return DockerStatus(True, f"{named} applies CDI ({on}) from {', '.join(dirs)} ({where})", spec_dirs=dirs,
                        spec_dir_fix=dir_fix)


def _configure_command(version: str | None) -> str:
    return "devinject runtime configure --runtime docker" + (f" --runtime-version {version}" if version else "")


def _cdi_off(path: str, data: DaemonJson, read: str, *, daemon: Daemon, version: str | None,
             known: tuple[int, int] | None) -> DockerStatus | None:
    """Why dockerd applies no CDI with this daemon.json and command line (a key set twice, features.cdi false,
    or unset before 28.2), with its fix; None where CDI is on."""
    named = f"docker {version}" if version else "docker"
    flag_features, flag_dirs = daemon.features, daemon.spec_dirs
    clashes = [(k, f[1]) for k, f in (("features", flag_features), ("cdi-spec-dirs", flag_dirs)) if f and k in data]
    if clashes:
        keys = ", ".join(k for k, _ in clashes)
        return DockerStatus(False, f"{path}: {keys} set both here and on dockerd's command line "
                            f"({'; '.join(dict.fromkeys(w for _, w in clashes))}): dockerd refuses to start",
                            f"remove {keys} from {path} or the flag, then systemctl restart docker")
    cdi = _cdi_feature(data, daemon)
    source = f"--feature on dockerd's command line ({flag_features[1]})" if flag_features else read
    if cdi is False:
        fix = (f"remove --feature cdi=false from dockerd's command line ({flag_features[1]})" if flag_features
               else f"set features.cdi to true in {path} (an admin turned it off)")
        return DockerStatus(False, f"{named}: CDI is off (features.cdi false, {source})", f"{fix}, then "
                            "systemctl restart docker")
    if cdi is None and (known is None or known < CDI_BY_DEFAULT):
        why = ("needs features.cdi before 28.2" if known is not None else
               "reads CDI without features.cdi only from 28.2, and its version is unknown (give --runtime-version)")
        fix = (f"add --feature cdi=true to dockerd's command line ({flag_features[1]})" if flag_features
               else _configure_command(version))
        return DockerStatus(False, f"{named}: CDI is off: features.cdi is not set ({source}); docker {why}",
                            f"{fix}, then systemctl restart docker")
    return None


def _status_spec_dirs(path: str, data: DaemonJson, read: str, *, daemon: Daemon,
                      version: str | None) -> tuple[tuple[str, ...], str, str]:
    """The dirs dockerd reads specs from, where that is set, and the fix that adds one ({spec_dir} to fill)."""
    flag_dirs = daemon.spec_dirs
    if flag_dirs is not None:
        return (flag_dirs[0], f"--cdi-spec-dir on dockerd's command line ({flag_dirs[1]})",
                f"add --cdi-spec-dir {{spec_dir}} to dockerd's command line ({flag_dirs[1]}), then restart it")
    dirs = tuple(data.get("cdi-spec-dirs", DOCKER_SPEC_DIRS))
    where = f"cdi-spec-dirs in {path}" if "cdi-spec-dirs" in data else f"docker's defaults ({read})"
    return dirs, where, _configure_command(version) + " --spec-dir {spec_dir}, then systemctl restart docker"


def node_status(root: str, *, version: str | None, hook_installed: bool, config: str | None = None) -> DockerStatus:
    """`status` for the node under `root`: the daemon.json its dockerd reads (`config`, else the --config-file of
    the dockerd running or its unit names when they agree on one, else the default), the flags it runs with, its
    version (asked only on /)."""
    path = config or _daemon_config(root)
    daemon = find_daemon(root, path)
    try:
        text = read_bytes_text(path)
    except ConfigError as err:
        return DockerStatus(False, err.message.removesuffix("; nothing written"), f"make {path} readable JSON")
    return status(path, text, version=version or daemon_version(root, daemon), daemon=daemon,
                  hook_installed=hook_installed)


def _daemon_config(root: str) -> str:
    """The daemon.json the node's dockerd reads: the default when a dockerd (running, or its unit) reads it or
    none is found; else the one file every dockerd found reads (several dockerds on other files: the default)."""
    unit = unit_daemon(root)
    found = {f.config_file for _, f in running_daemons(root)} | ({unit.config_file} if unit is not None else set())
    if len(found) == 1:
        return in_root(root, found.pop())
    return in_root(root, DEFAULT_CONFIG)
