"""`devinject hook` (OCI prestart / createRuntime / poststop); `devinject cdi-hook` (CDI createContainer) is
hook/cdihook.py's, handed on from `main` here.

Lean on purpose: stdlib, the CDI model and a spec cache; no click, yaml or pynvml (pyroute2 only when a spec
moves network devices). tests/e2e/test_hook_edges.py checks a real run's imports.
Errors are one line on stderr starting `devinject: error:` and a non-zero exit; nothing goes to stdout.
"""

from __future__ import annotations

import os
import sys
import time

from devinject.core import jsonlite
from devinject.core.errors import DevinjectError, HookError
from devinject.core.paths import DEFAULT_SPEC_DIRS, DEFAULT_STATE_DIR
from devinject.hook import fastjson

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from devinject.cdi.identity import NodeId
    from devinject.cdi.model import NetDevice
    from devinject.hook.cgroup import CgroupGrant
    from devinject.hook.plan import AllowDevice, Plan
    from devinject.hook.registry import Registry, Resolved
    from devinject.nodestate.ledger import Booking

SERVED_BY: int | None = None  # the hook server's pid, when a worker of it runs this invocation
CONFIG_FILE = "/etc/devinject/hook.json"
DEFAULT_LOG = "/var/log/devinject/hook.log"
SONAME_MEMO = "sonames.json"  # in the state dir: hook/linkercache.py's SonameMemo
USAGE = """usage: devinject hook [--spec-dir DIR]... [--profile-dir DIR]... [--log-file FILE] [--state-dir DIR]
                      [--config FILE]
                      [--env-requests | --no-env-requests] [--no-ledger] [--dry-run]
                      [--server SOCKET | --no-server]
                      [--stage prestart|createRuntime|poststop] < state.json
       devinject cdi-hook create-symlinks|update-ldcache|update-application-profile|links-and-ldcache ...
                          < state.json   (cdi-hook --help)"""
FLAGS = f"""The OCI hook: reads the container's state on stdin and gives it the CDI devices it asks for (its
cdi.k8s.io/* annotations; env requests only when turned on). Runtimes run it; `devinject install-hook` installs it.

  --spec-dir DIR          CDI spec directory (repeatable; later wins) [default: {', '.join(DEFAULT_SPEC_DIRS)}]
  --profile-dir DIR       extra device profiles: sharing modes, vendor request variables (repeatable)
  --log-file FILE         one JSON line per invocation [default: {DEFAULT_LOG}]
  --state-dir DIR         the ledger, spec cache and SONAME memo [default: {DEFAULT_STATE_DIR}]
  --config FILE           JSON defaults for these flags [default: {CONFIG_FILE}]
  --env-requests          also honour DEVINJECT_DEVICES, NVIDIA_VISIBLE_DEVICES, ... (set by the image and the
                          pod user: off by default); --no-env-requests turns it off over --config
  --no-ledger             do not book devices in the node's ledger (two containers may get one device)
  --dry-run               resolve and plan, print what would be done as JSON on stdout, change nothing
  --server SOCKET         hand the invocation to the hook server there; --no-server runs it in-process
  --stage STAGE           prestart, createRuntime or poststop [default: the state's status tells]
  -h, --help              this text (docs/hook.md says more)"""


class HookOptions:
    def __init__(self) -> None:
        self.spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS
        self.log_file: str | None = DEFAULT_LOG
        self.state_dir: str = DEFAULT_STATE_DIR
        self.env_requests: bool = False  # the image and the pod user set env: trusted only when the admin says
        self.ledger: bool = True
        self.stage: str | None = None
        self.dry_run: bool = False  # resolve and plan, print what would be done, change nothing
        self.profile_dirs: tuple[str, ...] = ()  # extra device profiles (sharing modes, request variables)


_CONFIG_TYPES: dict[str, type | tuple[type, ...]] = {
    "env_requests": bool, "ledger": bool, "state_dir": str, "log_file": (str, type(None)),
}


def _json_problem(path: str, text: str, err: ValueError) -> str:
    """`FILE:LINE:COL: problem` for a config jsonlite refused, as json reads it (the error path only)."""
    import json

    try:
        json.loads(text, parse_constant=jsonlite.loads)  # NaN, Infinity: refused, as jsonlite does
    except json.JSONDecodeError as where:
        return f"{path}:{where.lineno}:{where.colno}: {where.msg}"
    except ValueError:
        pass
    return f"{path}: invalid config: {err}"


def _load_config(path: str, opts: HookOptions, *, required: bool) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        if required:
            raise HookError(f"{path}: no such config file") from None
        return
    except (OSError, ValueError) as err:  # ValueError: not UTF-8
        raise HookError(f"{path}: invalid config: {err}") from None
    try:
        data = jsonlite.loads(text)
    except ValueError as err:
        raise HookError(_json_problem(path, text, err)) from None
    if not isinstance(data, dict):
        raise HookError(f"{path}: expected a JSON object")
    for key, value in data.items():
        if key in ("spec_dirs", "profile_dirs") and isinstance(value, list) and all(isinstance(v, str) for v in value):
            setattr(opts, key, tuple(value))
        elif _CONFIG_TYPES.get(key) is not None and isinstance(value, _CONFIG_TYPES[key]):
            setattr(opts, key, value)
        else:
            raise HookError(f"{path}: {key}: unknown key or wrong type")


def parse_hook_args(args: list[str], opts: HookOptions | None = None) -> HookOptions:
    """The hook's options: the --config file's, then the flags over them. `opts` is filled in place, so that
    when the config cannot be used the caller still has the flags (where to log, --dry-run) for its error."""
    opts = opts if opts is not None else HookOptions()
    config, config_required = CONFIG_FILE, False
    spec_dirs: list[str] = []
    profile_dirs: list[str] = []
    overrides: dict[str, object] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        takes_value = name in ("--spec-dir", "--profile-dir", "--log-file", "--state-dir", "--config", "--stage",
                               "--server")
        if takes_value:
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise HookError(f"{name}: needs a value")
            if name == "--spec-dir":
                spec_dirs.append(value)
            elif name == "--profile-dir":
                profile_dirs.append(value)
            elif name == "--config":
                config, config_required = value, True
            elif name == "--server":
                pass  # the launcher's: which hook server to hand the request to (hook/client.py)
            elif name == "--stage":
                if value not in ("prestart", "createRuntime", "poststop"):
                    raise HookError(f"--stage: {value!r} is not prestart, createRuntime or poststop")
                overrides["stage"] = value
            else:
                overrides[name[2:].replace("-", "_")] = str(value)
        elif arg in ("--env-requests", "--no-env-requests"):
            overrides["env_requests"] = arg == "--env-requests"
        elif arg == "--no-server":
            pass  # the launcher's, as --server
        elif arg == "--no-ledger":
            overrides["ledger"] = False
        elif arg == "--dry-run":
            overrides["dry_run"] = True
        elif arg in ("-h", "--help"):
            print(USAGE + "\n\n" + FLAGS)
            raise SystemExit(0)
        else:
            raise HookError(f"unknown argument {arg!r}\n{USAGE}")
        i += 1
    try:
        _load_config(config, opts, required=config_required)
    finally:  # the flags hold whether or not the config could be read
        for key, setting in overrides.items():
            setattr(opts, key, setting)
        if spec_dirs:
            opts.spec_dirs = tuple(spec_dirs)
        if profile_dirs:
            opts.profile_dirs = tuple(profile_dirs)
    return opts


def _log(opts: HookOptions, record: dict[str, object]) -> None:
    """One JSON line appended to the log (0644, its directory 0755, whatever the umask), never through a
    link and never into a directory others can write. A log that cannot be written is skipped with a
    warning on stderr: a container does not fail for a log line (the runtime may give no writable /var/log)."""
    if not opts.log_file:
        return
    from devinject.linux.trusteddir import append, trusted_dir

    try:
        trusted_dir(os.path.dirname(opts.log_file) or ".", what="log directory")
        append(opts.log_file, (jsonlite.dumps(record, sort_keys=True) + "\n").encode())
    except DevinjectError as err:
        print(f"devinject: warning: {err.message}; not logged", file=sys.stderr)
    except OSError as err:
        print(f"devinject: warning: {opts.log_file}: {err.strerror}; not logged", file=sys.stderr)


def _trusted_state_dir(opts: HookOptions) -> str:
    """The state dir, created 0755 or checked (root's alone) before the hook reads anything from it: the
    ledger, health verdicts, profile facts and cached parses there decide what a container gets."""
    from devinject.linux.trusteddir import trusted_dir

    return trusted_dir(opts.state_dir, error=HookError)


def _process_ids(config: dict[str, object]) -> tuple[int, int]:
    """process.user uid/gid from config.json: the owner CDI gives nodes that do not name one."""
    process = config.get("process")
    user = process.get("user") if isinstance(process, dict) else None
    if not isinstance(user, dict):
        return 0, 0
    uid, gid = user.get("uid", 0), user.get("gid", 0)
    if not isinstance(uid, int) or not isinstance(gid, int) or isinstance(uid, bool) or isinstance(gid, bool):
        raise HookError("config.json: process.user uid/gid must be integers")
    return uid, gid


def _shareable(kinds: set[str], policy: dict[str, str]) -> bool:
    modes = {policy[kind] for kind in kinds if kind in policy}
    return modes == {"shared"}


class HostParts:
    """The hook's effects on the node, one method each. `run_hook` only orchestrates them and undoes them
    in reverse on failure; a test passes recording parts, and `--dry-run` passes parts that only say."""

    def __init__(self, opts: HookOptions) -> None:
        self.opts = opts
        self.registry: Registry | None = None

    def resolve(self, names: tuple[str, ...]) -> Resolved:
        from devinject.hook.registry import Registry

        cache = os.path.join(self.opts.state_dir, "spec-cache.json")
        self.registry = Registry(self.opts.spec_dirs, cache_file=cache)
        return self.registry.resolve(names)

    def book(self, container_id: str, pid: int, resolved: Resolved) -> Booking | None:
        if not self.opts.ledger:
            return None
        from devinject.hook.plan import node_identity
        from devinject.nodestate.ledger import Claim, Ledger
        from devinject.nodestate.profilefacts import sharing_policy

        policy = sharing_policy(self.opts.state_dir, profile_dirs=self.opts.profile_dirs)
        offered_by: dict[str, set[str]] | None = None
        parents: dict[str, set[str]] = {}
        claims = []
        for name, edits in resolved.devices:
            kind = name.partition("=")[0]
            shared: tuple[NodeId, ...] = ()
            if self.registry is not None and kind not in policy:
                # a kind no profile describes (a gpu-nic bundle): each node is booked as the kinds that offer
                # it alone do; shared only when every one of them is shared (a node none offers: exclusive)
                offered_by = offered_by if offered_by is not None else self.registry.node_kinds()
                shared = tuple(node_identity(n) for n in edits.device_nodes
                               if _shareable(offered_by.get(n.host_path or n.path, set()), policy))
            elif self.registry is not None and policy[kind] == "exclusive":
                # partitions (MIG devices) of one GPU hold its node together; their own nodes stay exclusive
                if kind not in parents:
                    parents[kind] = self.registry.partition_parents(kind)
                shared = tuple(node_identity(n) for n in edits.device_nodes
                               if (n.host_path or n.path) in parents[kind])
            claims.append(Claim(name, tuple(node_identity(n) for n in edits.device_nodes), shared))
        ledger = Ledger(self.opts.state_dir, profile_dirs=self.opts.profile_dirs)
        return ledger.book(container_id, pid, tuple(claims), policy)

    def grant(self, pid: int, rules: tuple[AllowDevice, ...]) -> tuple[CgroupGrant | None, str | None]:
        """Allow `rules` in the container's device cgroup: (the grant, for revert/done; where)."""
        from devinject.hook.cgroup import CgroupGrant, device_cgroup_of

        cgroup = device_cgroup_of(pid)
        if cgroup is None:
            return None, None
        grant = CgroupGrant(cgroup)
        grant.allow(rules)
        return grant, f"v{cgroup.version} {cgroup.path}"

    def move_in(self, pid: int, devices: tuple[NetDevice, ...]) -> list[NetDevice]:
        from devinject.hook import netdev

        return netdev.move_in(pid, devices)

    def move_out(self, pid: int, devices: list[NetDevice]) -> None:
        from devinject.hook import netdev

        netdev.move_out(pid, devices)

    def apply(self, pid: int, rootfs: str, steps: Plan) -> list[str]:
        from devinject.hook.executor import Executor
        from devinject.hook.linkercache import SonameMemo
        from devinject.hook.nsenter import in_mount_namespace

        memo_file = os.path.join(self.opts.state_dir, SONAME_MEMO)
        sonames = SonameMemo.load(memo_file) if steps.ldcache_folders else None  # read and saved on the host
        done: list[str] = in_mount_namespace(pid, lambda: Executor(rootfs, sonames).apply(steps))
        if sonames is not None:
            sonames.save(memo_file)
        return done


class DryRunParts(HostParts):
    """`--dry-run`: resolve and plan for real (the same specs, the same checks), change nothing; the steps
    are the executor's walk through the plan, listed in its words (hook/executor.py RecordingExecutor)."""

    def book(self, container_id: str, pid: int, resolved: Resolved) -> Booking | None:
        return None

    def grant(self, pid: int, rules: tuple[AllowDevice, ...]) -> tuple[CgroupGrant | None, str | None]:
        return None, "dry run: " + ", ".join(rule.rule for rule in rules)

    def move_in(self, pid: int, devices: tuple[NetDevice, ...]) -> list[NetDevice]:
        return []

    def apply(self, pid: int, rootfs: str, steps: Plan) -> list[str]:
        from devinject.hook.executor import RecordingExecutor

        return RecordingExecutor().apply(steps)  # the executor's own walk and words, performing nothing


def run_hook(opts: HookOptions, stdin_fd: int = 0, started: float | None = None,
             parts: HostParts | None = None) -> dict[str, object]:
    from devinject.hook.state import load_bundle, parse_state, read_stdin

    if parts is None:
        parts = DryRunParts(opts) if opts.dry_run else HostParts(opts)
    record: dict[str, object] = {}
    state = parse_state(read_stdin(stdin_fd))
    record.update(container=state.id, status=state.status)
    stage = opts.stage or ("poststop" if state.status == "stopped" else "prestart")
    record["stage"] = stage
    if stage == "poststop":
        if opts.ledger and not opts.dry_run:
            from devinject.nodestate.ledger import Ledger

            record["released"] = Ledger(opts.state_dir).release(state.id)  # its lock checks the dir
        return record
    from devinject.hook.request import pod_request, requested_devices

    bundle = load_bundle(state)
    vendor_env = None
    if opts.env_requests:  # the profiles name the variables (cached: no YAML on a warm start)
        from devinject.nodestate.profilefacts import request_variables

        vendor_env = request_variables(opts.state_dir, profile_dirs=opts.profile_dirs)  # checks the dir
    request = requested_devices({**bundle.annotations, **state.annotations}, bundle.env,
                                allow_env=opts.env_requests, vendor_env=vendor_env)
    pod = None
    if state.pid > 0:
        from devinject.nodestate.podcgroup import pod_of

        pod = pod_of(state.pid)
    if pod is not None:  # a pod user writes its annotations and env: only the node's agents' word counts
        _trusted_state_dir(opts)
        request, untrusted = pod_request(request, bundle.env, pod, opts.state_dir)
        record["pod"] = pod
        if untrusted:
            record["untrusted"] = untrusted
    record["devices"] = list(request.names)
    if not request.names:
        record["result"] = "nothing requested"
        return record
    record["source"] = request.source
    if not opts.dry_run and (state.pid <= 0 or not os.path.exists(f"/proc/{state.pid}")):
        raise HookError(f"container {state.id}: process {state.pid} is gone")

    from devinject.hook.plan import plan

    timings: dict[str, float] = {}
    record["ms"] = timings
    mark = started if started is not None else time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        timings[name] = round((now - mark) * 1000, 2)
        mark = now

    _trusted_state_dir(opts)
    lap("prepare")  # arguments, state, bundle, request, imports
    resolved = parts.resolve(request.names)
    lap("resolve")
    uid, gid = _process_ids(bundle.raw)
    steps = plan(resolved.edits, uid=uid, gid=gid)
    record["warnings"] = list(steps.warnings)
    lap("plan")
    booking = parts.book(state.id, state.pid, resolved)
    if booking is not None:
        lap("ledger")
    grant = None
    moved: list[NetDevice] = []  # network interfaces moved into the container, for rollback
    try:
        grant, where = parts.grant(state.pid, steps.allow)
        if where is not None:
            record["cgroup"] = where
        lap("cgroup")
        if steps.net_devices:
            moved = parts.move_in(state.pid, steps.net_devices)
            record["net_devices"] = [f"{d.host_interface_name} -> {d.name}" for d in steps.net_devices]
            lap("network")
        record["steps"] = parts.apply(state.pid, bundle.rootfs, steps)
        lap("container")
    except BaseException:  # undo in reverse order; each undo is best effort
        if moved:
            parts.move_out(state.pid, moved)
        if grant is not None:
            grant.revert()
        if booking is not None:
            booking.cancel()
        raise
    if grant is not None:
        grant.done()
    record["result"] = "dry run" if opts.dry_run else "ok"
    return record


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "cdi-hook":
        from devinject.hook.cdihook import main as cdi_hook_main

        return cdi_hook_main(args)
    fastjson.install()  # the hook's JSON codec: the standard one costs imports on every start
    from devinject.hook import fastlibc  # and its C library

    fastlibc.install()
    started = time.monotonic()
    opts = HookOptions()
    record: dict[str, object] = {"command": command, "time": time.time()}
    if SERVED_BY is not None:
        record["server"] = SERVED_BY
    try:
        parse_hook_args(args, opts)
        record.update(run_hook(opts, started=started))
        if opts.dry_run:  # the one case the hook writes to stdout: an admin asked what it would do
            print(jsonlite.dumps(record, sort_keys=True))
        return 0
    except DevinjectError as err:
        record["error"] = err.message
        print(f"devinject: error: {err.message}", file=sys.stderr)
        return 1
    except Exception as err:
        record["error"] = f"internal: {type(err).__name__}: {err}"
        print(f"devinject: error: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    finally:
        record["duration_ms"] = round((time.monotonic() - started) * 1000, 2)
        if not opts.dry_run and (record.get("devices") or record.get("error") or record.get("untrusted")
                                 or record.get("released") not in (None, "not allocated")):
            _log(opts, record)  # a dry run changes nothing, its log included
