"""The `devinject` command line: click parsing and exit codes only; the work is in the library."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from devinject import __version__
from devinject.cdi.cdiversion import DEFAULT_VERSION_CAP, KNOWN_VERSIONS
from devinject.core.errors import DevinjectError, UsageError
from devinject.core.paths import (
    DEFAULT_KERNEL_LOG,
    DEFAULT_STATE_DIR,
    DYNAMIC_SPEC_DIR,
    HOOK_SOCKET,
    NFD_FEATURES_DIR,
    STATIC_SPEC_DIR,
)

if TYPE_CHECKING:
    from devinject.agent.watch import WatchOptions
    from devinject.api import Node
    from devinject.specs.hooks import HookCommand

log = logging.getLogger("devinject")

# long-running: `kubectl logs` / the journal is how they are read
AGENT_COMMANDS = ("watch", "device-plugin", "dra-driver")

bundles_option = click.option(
    "--bundles", "bundles", multiple=True, type=click.Choice(["gpu-nic"]),
    help="Also offer co-bound devices: gpu-nic = each GPU with its closest RDMA NIC (<vendor>/gpu-nic=<index>) "
         "and each NUMA node's GPUs and NICs (=numa<N>); see `devinject topo`.")
root_option = click.option(
    "--host-root", "--root", "root", default="/", show_default=True, metavar="DIRECTORY",
    help="Read the host under this directory (the host's / mounted in a pod, a driver root, a fixture host).",
)
kind_option = click.option(
    "--kind", "kinds", multiple=True, metavar="KIND",
    help="Only devices of KIND, e.g. nvidia.com/gpu (repeatable; exit 1 when one has none).")
driver_root_option = click.option(
    "--driver-root", default=None, type=click.Path(), metavar="DIRECTORY",
    help="Where the driver's files are, as the host names it (a driver installed in a container, e.g. "
         "/run/nvidia/driver): libraries, binaries and firmware come from there, device nodes from the host.")
nvml_option = click.option(
    "--nvml/--no-nvml", default=None,
    help="Ask NVML (the driver's libnvidia-ml under the root or --driver-root) for its GPUs' facts: UUIDs, "
         "memory, compute capability, MIG profiles (default: only when --root is /).")
target_root_option = click.option(
    "--target-root", default=None, type=click.Path(), metavar="DIRECTORY",
    help="The host's / as the runtime that reads the specs sees it (usually /): host paths are written under it "
         "instead of under --host-root.")

profile_dir_option = click.option(
    "--profile-dir", "profile_dirs", multiple=True, metavar="DIRECTORY",
    help="Extra directory of device profiles (besides <root>/etc/devinject/profiles.d; repeatable).")
node_hook_option = click.option(
    "--node-hook", default=None, metavar="DIRECTORY",
    help="Run the specs' CDI hooks from the node hook bundle installed in DIRECTORY (a host path; see "
         "install-node-hook). No spec is written until that bundle is there, is this devinject's and runs. "
         "Use it instead of --hook-path.")


def _checked_hook_path(root: str, target_root: str | None, hook_path: str | None) -> str:
    """The hook path the specs will name (`--hook-path`, else this devinject's), refused in one line when the
    runtime reading them could not run it, before anything is written: not absolute, or, where this process
    sees the reader's files (the host itself: `--root /`; or `--target-root`, found under `--root`), missing,
    not an executable file, or someone else's (it runs as root). Specs for another root keep it as given."""
    from devinject.specs.generate import default_hook_path
    from devinject.specs.validate import hook_program_problem

    path = hook_path or default_hook_path()
    option = "--hook-path" if hook_path else "the default hook path"
    if not path.startswith("/"):
        raise DevinjectError(f"{option} {path}: must be an absolute path (the runtime runs it from anywhere); "
                             "nothing written")
    local: str | None = None
    if target_root is None:
        local = path if os.path.realpath(root) == "/" else None
    elif path == target_root or path.startswith(target_root.rstrip("/") + "/"):
        local = os.path.join(root, os.path.relpath(path, target_root))
    problem = hook_program_problem(path, local) if local is not None else None
    if problem:
        raise DevinjectError(f"{option}: {problem}; nothing written",
                             hint="give --hook-path with a devinject the runtime can run, or --node-hook DIR")
    return path


def _node_hook(root: str, node_hook: str | None, hook_path: str | None, target_root: str | None) -> str | None:
    """--node-hook DIR: the hook path of the bundle there, once it is ready (else one line why, exit 1); under
    the target root, or else the root, as the specs' other host paths. Without it, the hook path checked
    (`_checked_hook_path`)."""
    if node_hook is None:
        return _checked_hook_path(root, target_root, hook_path)
    if hook_path is not None:
        raise UsageError("--node-hook and --hook-path: give one (--node-hook DIR sets the hook path)")
    from devinject.install.nodehook import hook_path as bundle_hook_path
    from devinject.install.nodehook import in_root, node_hook_ready

    problem = node_hook_ready(root, node_hook)
    if problem:
        raise DevinjectError(f"--node-hook {node_hook}: {problem}", hint="devinject install-node-hook installs it")
    return bundle_hook_path(in_root(root if target_root is None else target_root, node_hook))


def _bundle_command(node_hook: str | None, hook_path: str | None) -> HookCommand | None:
    """With --node-hook, what the specs' CDI hooks run: the bundle's launcher's command (`hook_path`, as
    `_node_hook` made it), named directly."""
    if node_hook is None or hook_path is None:
        return None
    from devinject.install.nodehook import LAUNCHER, bundle_command

    return bundle_command(hook_path.removesuffix(f"/{LAUNCHER}"))


def _node(*, root: str = "/", target_root: str | None = None, profile_dirs: tuple[str, ...] = (),
          state_dir: str | None = None, kernel_log: str | None = None, nvml: bool | None = None,
          driver_root: str | None = None) -> Node:
    """The node a command was pointed at (devinject.api), its roots checked once before it reads anything: a
    wrong one is one line naming it (discovery/roots.py). The kernel log may be missing only when it was not
    asked for."""
    from click.core import ParameterSource

    from devinject.api import Node

    source = click.get_current_context().get_parameter_source("kernel_log")
    return Node(root, target_root=target_root, profile_dirs=profile_dirs, state_dir=state_dir,
                kernel_log=kernel_log, kernel_log_explicit=source not in (None, ParameterSource.DEFAULT),
                nvml=nvml, driver_root=driver_root)


def _check_roots(*, root: str = "/", profile_dirs: tuple[str, ...] = (), state_dir: str | None = None,
                 kernel_log: str | None = None) -> None:
    """The roots of a command that reads no devices here (install-node-hook), checked as _node checks them."""
    _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log)


def note(text: str, *, error: bool = False) -> None:
    """A line for the user on stderr (what was written, what was not found, a warning; or, `error`, a problem
    found). The one place that decides what -q keeps: errors only, as it keeps the log at error level."""
    ctx = click.get_current_context(silent=True)
    if error or ctx is None or not ctx.find_root().params.get("quiet"):
        click.echo(text, err=True)


class _Group(click.Group):
    """Turns library errors into one line on stderr and exit 1; no tracebacks for users."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DevinjectError as err:
            hint = f" ({err.hint})" if err.hint else ""
            click.echo(f"devinject: error: {err.message}{hint}", err=True)
            ctx.exit(err.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="devinject")
@click.option("-v", "--verbose", count=True,
              help="More logging (repeat for debug); watch and device-plugin log at info already.")
@click.option("-q", "--quiet", is_flag=True,
              help="Errors only on stderr: no log below error, no 'wrote ...' or 'no devices found' lines.")
def cli(verbose: int, quiet: bool) -> None:
    """Discover accelerators, write CDI specs, and inject devices into containers."""
    if click.get_current_context().invoked_subcommand in AGENT_COMMANDS:
        verbose = max(verbose, 1)  # a node agent's log is what it did: at info unless -q
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="devinject: %(levelname)s: %(message)s", stream=sys.stderr)


@cli.command()
@root_option
@click.option("--output-dir", default=None, type=click.Path(file_okay=False), metavar="DIRECTORY",
              help=f"Write one <vendor>-<class> spec per kind here [default: {STATIC_SPEC_DIR} when --root is /, "
                   "else stdout: a fixture's or a mounted host's paths never land in this machine's spec dir].")
@click.option("-o", "--output", "output", default=None, metavar="FILE",
              help="Write to this file instead ('-' for stdout).")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
              help="The spec files' format.")
@click.option("--device-name-strategy", "strategies", multiple=True,
              type=click.Choice(["index", "uuid", "pci"]),
              help="Names to give each device (repeatable). Default: index and uuid, or index and pci.")
@click.option("--cdi-version", "version_cap", default=DEFAULT_VERSION_CAP, show_default=True,
              type=click.Choice(KNOWN_VERSIONS), help="Highest CDI version to emit (podman 4, containerd 1.7: 0.5.0).")
@click.option("--kind", "kinds", multiple=True, metavar="KIND",
              help="Only this kind, e.g. nvidia.com/gpu (repeatable; exit 1 when one has no devices).")
@click.option("--hook-path", default=None, metavar="PATH", help="Absolute path of devinject for the spec's CDI hooks.")
@profile_dir_option
@nvml_option
@bundles_option
@target_root_option
@driver_root_option
@node_hook_option
def generate(root: str, output_dir: str | None, output: str | None, fmt: str, strategies: tuple[str, ...],
             version_cap: str, kinds: tuple[str, ...], hook_path: str | None, profile_dirs: tuple[str, ...],
             nvml: bool | None, bundles: tuple[str, ...], target_root: str | None, driver_root: str | None,
             node_hook: str | None) -> None:
    """Discover devices on the host and write CDI specs."""
    if output is None and output_dir is None:
        # the node's own spec dir only for the node's own devices
        output, output_dir = ("-", None) if os.path.realpath(root) != "/" else (None, STATIC_SPEC_DIR)
    node = _node(root=root, target_root=target_root, profile_dirs=profile_dirs)
    hook_path = _node_hook(root, node_hook, hook_path, target_root)
    from devinject.cdi.spec import write_atomic
    from devinject.specs.generate import GenerateOptions, render, write_specs

    opts = GenerateOptions(kinds=kinds, strategies=strategies, version_cap=version_cap, hook_path=hook_path,
                           node_hook=_bundle_command(node_hook, hook_path), nvml=nvml, bundles=bundles,
                           driver_root=driver_root)
    specs = node.specs(opts)
    missing = _missing_kinds(kinds, {spec.kind for spec in specs})
    if not specs or missing:
        why = node.why_no_devices(missing or kinds)
        if missing:  # a kind asked for and not there: the admin's expectation failed
            raise DevinjectError(f"{why}; nothing written")
        note(f"{why}; nothing written")
        return
    from devinject.cdi.spec import spec_dir_problem

    if output != "-":  # a spec dir others could write: the hook and validate refuse every spec in it
        directory = (output_dir or STATIC_SPEC_DIR) if output is None else os.path.dirname(os.path.abspath(output))
        problem = spec_dir_problem(directory)
        if problem:
            raise DevinjectError(f"{problem}; nothing written", hint="write into a directory only root can change")
    if output == "-":
        texts = [render(spec, fmt) for spec in specs]
        if fmt == "json" and len(texts) > 1:
            click.echo(json.dumps([json.loads(t) for t in texts], indent=2))
        else:
            click.echo("".join(texts), nl=False)
        return
    if output is not None:
        if len(specs) != 1:
            kinds_found = ", ".join(s.kind for s in specs)
            raise UsageError(f"--output {output}: {len(specs)} kinds found ({kinds_found}); "
                                 "a spec file holds one kind", hint="use --kind or --output-dir")
        write_atomic(Path(output), render(specs[0], fmt))
        note(f"wrote {output} ({specs[0].kind}, {len(specs[0].devices)} names)")
        return
    for spec, path in zip(specs, write_specs(specs, Path(output_dir or STATIC_SPEC_DIR), fmt), strict=True):
        note(f"wrote {path} ({spec.kind}, {len(spec.devices)} names)")


@cli.group()
def cdi() -> None:
    """The CDI names a runtime on this node resolves (from the spec dirs, as the hook reads them)."""


@cdi.command("list")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIRECTORY",
              help=f"A CDI spec directory, later ones win (repeatable) [default: {STATIC_SPEC_DIR}, "
                   f"{DYNAMIC_SPEC_DIR}].")
@click.option("--json", "as_json", is_flag=True, help="{names: {name: file}, conflicts: {name: why}, problems: [..]}.")
def cdi_list(spec_dirs: tuple[str, ...], as_json: bool) -> None:
    """Every device name the spec dirs offer and the file it comes from; a name defined twice at one priority
    (no runtime resolves it) and a spec file that cannot be read are listed apart, and exit 1."""
    from devinject.core.paths import DEFAULT_SPEC_DIRS
    from devinject.hook.registry import Registry

    registry = Registry(spec_dirs or DEFAULT_SPEC_DIRS)
    offered = registry.offered()
    if as_json:
        click.echo(json.dumps({"names": offered, "conflicts": registry.conflicts, "problems": registry.problems},
                              indent=2))
    else:
        width = max((len(n) for n in offered), default=0) + 2
        for name, path in offered.items():
            click.echo(f"{name:<{width}}{path}")
        for name, why in sorted(registry.conflicts.items()):
            note(f"{name}: unresolvable: {why} (same priority)", error=True)
        for problem in registry.problems:
            note(problem, error=True)
        if not offered and not registry.conflicts and not registry.problems:
            note(f"no CDI devices in {', '.join(spec_dirs or DEFAULT_SPEC_DIRS)}")
    if registry.conflicts or registry.problems:
        sys.exit(1)


@cli.command()
@click.argument("paths", nargs=-1)
@click.option("--max-version", default=None, metavar="VERSION",
              help="Refuse specs above this CDI version (default: accept every released version, and warn "
                   "about specs that podman 4.x and containerd 1.7 cannot read).")
@click.option("--node/--portable", "node_local", default=None,
              help="--node: the specs are this node's, so a hook that cannot run here is an error; --portable: "
                   "a warning (a spec made for another node). Default: --node for the node's own spec dirs "
                   "(no PATHS), --portable for PATHS.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the problems as a JSON list of {file, field, message, severity} (no ok lines).")
def validate(paths: tuple[str, ...], max_version: str | None, node_local: bool | None, as_json: bool) -> None:
    """Check CDI spec files: PATHS (files or directories), or else the CDI spec directories /etc/cdi and
    /var/run/cdi."""
    from devinject.core.paths import DEFAULT_SPEC_DIRS
    from devinject.specs.validate import check_paths

    targets = paths or tuple(d for d in DEFAULT_SPEC_DIRS if Path(d).is_dir())
    found = check_paths(targets, max_version=max_version, node_local=not paths if node_local is None else node_local)
    if as_json:
        click.echo(json.dumps([p.as_json() for p in found.problems], indent=2))
    else:
        for problem in found.errors:
            note(str(problem), error=True)
        for problem in found.warnings:
            note(f"warning: {problem}")
        for file in found.files:
            if found.valid(file):
                click.echo(f"ok: {file}")
    if found.errors:
        sys.exit(1)
    if not found.files and not as_json:
        note("no spec files found")


state_dir_option = click.option("--state-dir", default=DEFAULT_STATE_DIR, show_default=True, metavar="DIRECTORY",
                                help="devinject's node state: ledger, health, events.")
kernel_log_option = click.option(
    "--kernel-log", default="auto", show_default=True, metavar="SOURCE",
    help="Where the kernel's messages (NVIDIA Xids) are read, under --root: auto, kmsg (/dev/kmsg), journal "
         f"(journalctl), a syslog FILE; auto: kmsg if it can be opened, else the journal, else {DEFAULT_KERNEL_LOG}.")


@cli.command()
@root_option
@click.option("--format", "fmt", type=click.Choice(["text", "json", "dot", "svg"]), default="text", show_default=True,
              help="text: the matrix and GPU-NIC pairs; dot: the PCIe tree for Graphviz; svg: rendered by `dot`.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write to FILE, not stdout.")
@profile_dir_option
def topo(root: str, fmt: str, as_json: bool, output: str | None, profile_dirs: tuple[str, ...]) -> None:
    """How close the devices are in the PCIe tree and across NUMA nodes (as `nvidia-smi topo -m`, any vendor)."""
    from devinject.discovery.topology import render_dot

    node = _node(root=root, profile_dirs=profile_dirs)
    result = node.topology()
    fmt = "json" if as_json else fmt
    if not result.labels and fmt != "json":  # the JSON of no devices is the empty topology (docs/json.md)
        note(node.why_no_devices())
        return
    if fmt == "json":
        text = json.dumps(result.to_json(), indent=2) + "\n"
    elif fmt == "text":
        text = result.render()
    else:
        text = render_dot(result)
        if fmt == "svg":
            text = _graphviz_svg(text)
    if output is None:
        click.echo(text, nl=False)
        return
    from devinject.core.atomicfile import replace

    try:
        replace(output, text.encode(), 0o644)
    except OSError as err:
        raise DevinjectError(f"--output {output}: cannot write: {err.strerror}") from None


def _missing_kinds(asked: tuple[str, ...], found: set[str]) -> tuple[str, ...]:
    """The kinds of `--kind` a command found nothing of."""
    return tuple(kind for kind in dict.fromkeys(asked) if kind not in found)


def _check_kinds(node: Node, kinds: tuple[str, ...]) -> None:
    """`--kind` of a command whose rows are not the devices themselves (who, events, doctor): a kind the node
    has no device of is one line why, exit 1, as for `list`."""
    if kinds:
        found = {d.profile.kind for d in node.devices()} | {c.profile.kind for c in node.channels()}
        missing = _missing_kinds(kinds, found)
        if missing:
            raise DevinjectError(node.why_no_devices(missing))


def _graphviz_svg(dot_text: str) -> str:
    """`dot -Tsvg` from the host's Graphviz: clean environment, bounded time."""
    import shutil
    import subprocess

    dot = shutil.which("dot", path="/usr/local/bin:/usr/bin:/bin")
    if dot is None:
        raise DevinjectError("--format svg: Graphviz's `dot` is not installed (apt install graphviz), "
                             "or use --format dot")
    try:
        done = subprocess.run([dot, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        raise DevinjectError(f"--format svg: {dot} did not finish in 60 s") from None
    if done.returncode != 0:
        raise DevinjectError(f"--format svg: {dot} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def _sharing_cell(record: Any) -> str:
    """How a device is shared now: `time-slicing 2/4` (containers holding it / its replicas), `mps`, or its
    profile's `exclusive` / `shared`."""
    if record.sharing == "time-slicing" and record.replicas:
        pods_only = ("dra-claim:", "device-plugin:")  # bookings for pods, not containers
        held = len([h for h in record.holders if not str(h.container or "").startswith(pods_only)])
        return f"time-slicing {held}/{record.replicas}"
    return str(record.sharing)


@cli.command("list")
@root_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@kind_option
@profile_dir_option
@state_dir_option
@kernel_log_option
@nvml_option
@driver_root_option
def list_devices(root: str, as_json: bool, kinds: tuple[str, ...], profile_dirs: tuple[str, ...], state_dir: str,
                 kernel_log: str, nvml: bool | None, driver_root: str | None) -> None:
    """Show every discovered device, its health and which container holds it."""
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log, nvml=nvml,
                 driver_root=driver_root)
    rows = sorted((r for r in node.inventory() if not kinds or r.kind in kinds), key=_device_order)
    missing = _missing_kinds(kinds, {r.kind for r in rows})
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2))
    if missing:
        raise DevinjectError(node.why_no_devices(missing))
    if as_json:
        return
    if not rows:
        note(node.why_no_devices())
        return
    header = ("DEVICE", "PCI", "MODEL", "MEMORY", "CC", "NUMA", "DRIVER", "HEALTH", "SHARING", "HELD BY",
              "PAIRED WITH", "NODES")
    table = [header] + [
        (r.name, r.pci_address or "-", r.model, _memory_cell(r.memory_bytes), r.compute_capability or "-",
         "-" if r.numa_node is None else str(r.numa_node), r.driver or "-",
         r.health, _sharing_cell(r), ",".join(h.container or "?" for h in r.holders) or "-",
         ",".join(name for name, _ in r.paired_with) or "-", " ".join(path for path, _, _ in r.nodes))
        for r in rows
    ]
    found = {(f.profile.kind, f.address): f for f in node.devices()}
    at = 1
    for r in rows:  # a GPU split into MIG instances (an AMD GPU into partitions) is offered as those
        device = found.get((r.kind, r.pci_address or ""))
        gpu = node.gpu_facts(device) if device is not None else None
        at += 1
        for part in device.partitions if device is not None else ():
            mig = gpu.mig(part.gpu_instance, part.compute_instance) if gpu and part.kind == "mig" else None
            model = " ".join(filter(None, (part.kind.upper(), mig.profile if mig else None, part.key)))
            table.insert(at, (f"  {r.kind}={part.name}", "-", model, _memory_cell(mig.memory_bytes if mig else None),
                              "-", "-", "-", "-", "-", "-", "-", " ".join(n.path for n in part.nodes)))
            at += 1
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])


def _memory_cell(size: int | None) -> str:
    """A device's memory as nvidia-smi states it (`81559MiB`); `-` when not known."""
    return "-" if not size else f"{size // (1024 * 1024)}MiB"


def _device_order(record: Any) -> tuple[str, str, tuple[int | str, ...]]:
    """How list and health order devices: by kind, then PCI address (a channel, which has none, by number)."""
    import re

    name = tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", record.name))
    return record.kind, record.pci_address or "", name


def run(args: list[str]) -> int:
    try:
        cli.main(args=args, prog_name="devinject", standalone_mode=True)
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    return 0


@cli.command("hook-server")
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help=f"Where to listen [default: {HOOK_SOCKET}, where the hook looks].")
def hook_server(socket_path: str | None) -> None:
    """Serve `devinject hook` and the specs' `cdi-hook` from a resident process: each container start skips
    the hook's imports.

    The hook hands its invocation over when the socket answers and runs in-process otherwise."""
    from devinject.hook.client import DEFAULT_SOCKET
    from devinject.hook.server import serve

    try:
        serve(socket_path or DEFAULT_SOCKET)
    except OSError as err:
        raise DevinjectError(f"{socket_path or DEFAULT_SOCKET}: cannot serve: {err.strerror or err}") from None
    except KeyboardInterrupt:
        pass


def _lean_command(name: str, short: str, summary: str) -> None:
    """`hook` and `cdi-hook` run before click is imported (entry.py): listed here so that `devinject --help`
    names them; their --help is the hook's own. Click runs them only when cli.run is called directly."""

    @cli.command(name, short_help=short, help=summary, add_help_option=False,
                 context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.pass_context
    def lean(ctx: click.Context) -> None:
        from devinject.hook.main import main as hook_main

        ctx.exit(hook_main([name, *ctx.args]))


_lean_command("hook", "OCI hook: inject the devices a container asks for.",
              "The OCI hook (prestart, createRuntime, poststop): give a container the CDI devices it asks for, "
              "with cgroup grants and the device ledger (see install-hook).")
_lean_command("cdi-hook", "The specs' hooks: symlinks and the linker cache.",
              "The generated specs' createContainer hooks: create-symlinks, update-ldcache, links-and-ldcache "
              "(both in one process).")


@cli.command("install-hook")
@click.option("--hooks-dir", default=None, metavar="DIRECTORY",
              help="An existing hooks.d directory [default: /etc/containers/oci/hooks.d, made when missing].")
@click.option("--executable", default=None, metavar="FILE",
              help="Absolute path of the devinject program to run [default: this installation's interpreter on "
                   "its fast hook launcher].")
@click.option("--env-requests", is_flag=True,
              help="Run for every container so env requests (NVIDIA_VISIBLE_DEVICES, ...) work too.")
@click.option("--poststop", is_flag=True,
              help="Also run at container delete, releasing devices in the ledger at once (without it they are "
                   "freed on the ledger's next access, once the container's process is gone).")
@click.option("--server", "server_socket", default=None, metavar="SOCKET",
              help=f"The hook server's socket the hook hands container starts to [default: {HOOK_SOCKET}].")
@click.option("--runc-snippet", is_flag=True, help="Print the runc config.json hooks snippet instead.")
@click.option("--server-unit", is_flag=True,
              help="Also write the systemd unit of the hook server on that socket, run by this installation.")
@click.option("--unit-dir", default=None, metavar="DIRECTORY",
              help="Where --server-unit writes it [default: /etc/systemd/system].")
def install_hook(hooks_dir: str | None, executable: str | None, env_requests: bool, poststop: bool,
                 server_socket: str | None, runc_snippet: bool, server_unit: bool, unit_dir: str | None) -> None:
    """Install the OCI hook for CRI-O and podman (hooks.d 1.0.0)."""
    from devinject.hook.client import DEFAULT_SOCKET, server_answers
    from devinject.install.hooksd import (
        DEFAULT_HOOKS_DIR,
        DEFAULT_UNIT_DIR,
        HOOK_FILE,
        SERVER_UNIT,
        hook_command,
        hooks_d_entry,
        pod_annotation_passthrough,
        render,
        runc_hooks,
    )
    from devinject.install.hooksd import server_unit as render_server_unit
    from devinject.linux.trusteddir import write_file

    command = hook_command(executable and os.path.abspath(executable))
    if not os.access(command[0], os.X_OK):
        raise UsageError(f"--executable {command[0]}: not an executable file")
    server = os.path.abspath(server_socket) if server_socket else DEFAULT_SOCKET
    if runc_snippet:
        click.echo(render(runc_hooks(command, poststop=poststop, server=server)), nl=False)
    else:
        directory = Path(hooks_dir or DEFAULT_HOOKS_DIR)
        if hooks_dir is not None and not directory.is_dir() and not directory.absolute().parent.is_dir():
            # a typo'd path no runtime reads: only its last component is made, as `mkdir` would
            raise UsageError(f"--hooks-dir {hooks_dir}: no such directory as {directory.absolute().parent} (the "
                             "runtime reads hooks from a directory it is configured with: create that one first)")
        target = directory / HOOK_FILE  # what the runtime runs as root: written as trusteddir writes root's files
        write_file(str(target), render(hooks_d_entry(command, env_requests=env_requests, poststop=poststop,
                                                     server=server)).encode(), what="hooks.d file", sync=True)
        note(f"wrote {target}")
    for line in pod_annotation_passthrough():
        note(f"warning: {line}")
    if server_unit:
        unit = Path(unit_dir or DEFAULT_UNIT_DIR) / SERVER_UNIT
        write_file(str(unit), render_server_unit(command, server).encode(), what="systemd unit", sync=True)
        note(f"wrote {unit}; start it: systemctl daemon-reload && systemctl enable --now {SERVER_UNIT}")
    elif not server_answers(server):  # the hook still works: in-process, ~4 ms slower on each container start
        note(f"note: no hook server answers at {server}: each container start will load the hook itself; "
             f"run `devinject hook-server --socket {server}`, or install its unit (--server-unit)")


@cli.command("install-node-hook")
@root_option
@click.option("--dir", "directory", default="/opt/devinject/hook", show_default=True, metavar="DIRECTORY",
              help="Where the bundle goes, as the host names it (its parent must be writable here).")
@click.option("--check", is_flag=True, help="Install nothing: say whether the node hook there is ready (exit 1 "
                                            "and why when it is not).")
@click.option("--force", is_flag=True, help="Rebuild and replace it even when the one there is current.")
def install_node_hook(root: str, directory: str, check: bool, force: bool) -> None:
    """Install this devinject onto the host as a self-contained CDI hook (its interpreter, loader, libraries and
    modules: the node needs only /bin/sh) and print the --hook-path for specs; see docs/node-hook.md."""
    _check_roots(root=root)
    from devinject.install.nodehook import hook_path, in_root, install_node_hook, node_hook_ready

    if check:
        problem = node_hook_ready(root, directory)
        if problem:
            raise DevinjectError(problem)
        click.echo(hook_path(directory))
        return
    done = install_node_hook(root, directory, force=force)
    what = "installed" if done.changed else "already installed and current:"
    note(f"{what} {in_root(root, directory)} ({done.files} files, {done.size / 2**20:.1f} MiB); it runs")
    click.echo(done.hook_path)


@cli.command()
@root_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@kind_option
@profile_dir_option
@state_dir_option
@kernel_log_option
@click.option("--probe-timeout", default=2.0, show_default=True, type=click.FloatRange(0.1, 60),
              help="Seconds each device's probe may take before it counts as failed.")
def health(root: str, as_json: bool, kinds: tuple[str, ...], profile_dirs: tuple[str, ...], state_dir: str,
           kernel_log: str, probe_timeout: float) -> None:
    """Every device's verdict, as the node agent published it (else checked once, now); exit 0 only when all
    are healthy."""
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log)
    verdicts = sorted((v for v in node.health(timeout=probe_timeout) if not kinds or v.kind in kinds),
                      key=_device_order)
    missing = _missing_kinds(kinds, {v.kind for v in verdicts})
    if missing:
        raise DevinjectError(node.why_no_devices(missing))
    if as_json:
        click.echo(json.dumps([v.to_json() for v in verdicts], indent=2))
    else:
        width = max((len(v.name) for v in verdicts), default=0)
        for v in verdicts:  # named and ordered as `list` names and orders them
            click.echo(f"{v.name:{width}}  {v.pci_address or '-':12}  {v.health:9}  {'; '.join(v.reasons)}".rstrip())
        if not verdicts:
            note(node.why_no_devices())
    sys.exit(0 if all(v.healthy for v in verdicts) else 1)


def watch_options(command: Callable[..., None]) -> Callable[..., None]:
    """The health loop's options, shared by `watch` and `device-plugin` (which runs the same loop)."""
    for option in reversed((
        root_option,
        click.option("--output-dir", default=DYNAMIC_SPEC_DIR, show_default=True, type=click.Path(file_okay=False),
                     metavar="DIRECTORY", help=f"Dynamic spec dir (wins over {STATIC_SPEC_DIR})."),
        state_dir_option,
        click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
                     help="The spec files' format."),
        click.option("--interval", default=10.0, show_default=True, type=float,
                     help="Seconds between health checks (5-60)."),
        click.option("--recheck", default=1.5, show_default=True, type=float,
                     help="Seconds between re-checks of a failing device (1-2)."),
        click.option("--threshold", default=3, show_default=True, type=click.IntRange(1, 20),
                     help="Consecutive failures (or passes) before a device is taken out (or put back)."),
        click.option("--rescan", default=60.0, show_default=True, type=click.FloatRange(0.05, 3600),
                     help="Seconds between full rediscoveries (uevents trigger one at once)."),
        click.option("--test-timings", is_flag=True, hidden=True, help="Lift the interval ranges (tests, benchmarks)."),
        kernel_log_option,
        click.option("--hook-path", default=None, metavar="PATH",
                     help="Absolute path of devinject for the spec's CDI hooks."),
        click.option("--kind", "kinds", multiple=True, metavar="KIND", help="Only this kind (repeatable)."),
        click.option("--uevents/--no-uevents", default=True, show_default=True, help="Listen for kernel uevents."),
        click.option("--nfd-features-dir", default=None, metavar="DIRECTORY",
                     help="Write the node's labels for Node Feature Discovery there (its features.d, e.g. "
                          f"{NFD_FEATURES_DIR}), as the devices change."),
        bundles_option,
        target_root_option,
        driver_root_option,
        nvml_option,
        node_hook_option,
        profile_dir_option,
    )):
        command = option(command)
    return command


def _check_timings(interval: float, recheck: float, rescan: float, test_timings: bool) -> None:
    """The health loop's timings within the ranges it is made for (unless `--test-timings`)."""
    if not test_timings:
        if not 5 <= interval <= 60:
            raise UsageError(f"--interval {interval:g}: must be between 5 and 60 seconds")
        if not 1 <= recheck <= 2:
            raise UsageError(f"--recheck {recheck:g}: must be between 1 and 2 seconds")
    if min(interval, recheck, rescan) <= 0:
        raise UsageError("--interval, --recheck and --rescan must be positive")


def _watch_options(root: str, output_dir: str, state_dir: str, fmt: str, interval: float, recheck: float,
                   threshold: int, rescan: float, test_timings: bool, kernel_log: str, hook_path: str | None,
                   kinds: tuple[str, ...], uevents: bool, bundles: tuple[str, ...],
                   target_root: str | None, driver_root: str | None, node_hook: str | None = None,
                   profile_dirs: tuple[str, ...] = (), nfd_features_dir: str | None = None,
                   nvml: bool | None = None) -> tuple[WatchOptions, Node]:
    """The loop's options, and the node it watches (its roots checked once, here)."""
    from devinject.agent.watch import WatchOptions
    from devinject.linux.trusteddir import trusted_dir
    from devinject.specs.generate import GenerateOptions, default_hook_path

    node = _node(root=root, target_root=target_root, profile_dirs=profile_dirs, state_dir=state_dir,
                 kernel_log=kernel_log, nvml=nvml, driver_root=driver_root)
    trusted_dir(state_dir)  # health verdicts and events the hook trusts: refused when others could write there
    _check_timings(interval, recheck, rescan, test_timings)
    hook_path = _node_hook(root, node_hook, hook_path, target_root)
    gen = GenerateOptions(root=root, kinds=kinds, hook_path=hook_path or default_hook_path(), bundles=bundles,
                          node_hook=_bundle_command(node_hook, hook_path), target_root=target_root,
                          driver_root=driver_root, profile_dirs=profile_dirs, nvml=nvml)
    gen.check()
    return WatchOptions(generate=gen, output_dir=Path(output_dir), state_dir=state_dir, fmt=fmt, interval=interval,
                        recheck=recheck, threshold=threshold, rescan=rescan, kernel_log=kernel_log,
                        uevents=uevents, nfd_features_dir=nfd_features_dir), node


class _Stop(threading.Event):
    """An agent's stop: set by SIGTERM (its service manager: a clean stop, exit 0) or SIGINT (Ctrl-C: exit 130,
    as a shell expects), and said in the agent's log, so that a stop is never silent."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: int | None = None

    def on_signal(self, signum: int, _frame: object) -> None:
        import signal

        if self.signal is None:
            logging.getLogger("devinject").info("%s: stopping", signal.Signals(signum).name)
        self.signal = signum
        self.set()

    def exit(self) -> None:
        """Once the agent has stopped: Ctrl-C's status, or return for a clean stop."""
        import signal

        if self.signal == signal.SIGINT:
            logging.getLogger("devinject").warning("stopped (SIGINT)")
            sys.exit(130)
        if self.signal is not None:
            logging.getLogger("devinject").info("stopped (%s)", signal.Signals(self.signal).name)


def _stop_on_signals() -> _Stop:
    import signal

    stop = _Stop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop.on_signal)
    return stop


@cli.command()
@watch_options
def watch(**options: Any) -> None:
    """Keep the CDI specs true to the hardware: rescan on hot-plug, take out unhealthy devices."""
    from devinject.agent.watch import Watcher

    opts, node = _watch_options(**options)
    stop = _stop_on_signals()
    Watcher(opts, node=node).run(stop)
    stop.exit()


class ConfigFileError(UsageError):
    """A --config file that cannot be used: a usage error (exit 2, as click's), said in one line."""


def _load_config(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
    """`--config FILE`: a YAML mapping of this command's option names (without dashes) to values, read before
    the other options, which win over it. Unknown names are an error, not silently ignored."""
    if path is None:
        return None
    import yaml

    try:
        with open(path, "rb") as handle:  # bytes: PyYAML decodes, and marks where a file is not UTF-8
            data = yaml.safe_load(handle) or {}
    except OSError as err:
        raise ConfigFileError(f"{path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        from devinject.discovery.profiles import yaml_problem

        raise ConfigFileError(yaml_problem(path, err)) from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping of option names to values")
    known = {p.name: p for p in ctx.command.params if isinstance(p, click.Option) and p.name}
    names = {opt.lstrip("-").replace("-", "_"): p.name for p in known.values() for opt in p.opts if p.name}
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        if ctx.command.name == "device-plugin" and key in ("sharing", "version"):
            _sharing_section(ctx, path, str(key), value)  # NVIDIA's device plugin's shape, carried over
            continue
        name = names.get(str(key).replace("-", "_"))
        if name is None or name == "config":
            raise ConfigFileError(f"{path}: unknown option {key!r}")
        defaults[name] = list(value) if known[name].multiple and isinstance(value, list) else value
        try:  # checked here, where the file can be named (click would blame the option)
            known[name].type_cast_value(ctx, defaults[name])
        except click.BadParameter as err:
            raise ConfigFileError(f"{path}: {key}: {err.message}") from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def _check_metrics_address(address: str) -> None:
    if address:
        _, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise UsageError(f"--metrics-address {address!r}: expected HOST:PORT")


def _pod_uid(uid: str | None) -> str | None:
    from devinject.core.poduid import checked_pod_uid

    try:
        return None if uid is None else checked_pod_uid(uid)
    except DevinjectError as err:
        raise UsageError(err.message) from None


def _sharing_section(ctx: click.Context, path: str, key: str, value: object) -> None:
    """The device plugin's config: `sharing:` (time-slicing, docs/sharing.md) and NVIDIA's `version: v1`."""
    if key == "version":
        if value != "v1":
            raise ConfigFileError(f"{path}: version: expected v1 (the version of NVIDIA's config shape), got {value!r}")
        return
    from devinject.deviceplugin.sharing import SharingConfigError, parse_sharing

    try:
        ctx.meta["devinject.sharing"] = parse_sharing(value, path)
    except SharingConfigError as err:
        raise ConfigFileError(err.message) from None


@cli.command("device-plugin")
@click.option("--config", metavar="FILE", is_eager=True, expose_value=False, callback=_load_config,
              help="YAML file of option values (e.g. the DaemonSet's ConfigMap); flags given win over it.")
@watch_options
@click.option("--plugin-dir", default="/var/lib/kubelet/device-plugins", show_default=True,
              type=click.Path(file_okay=False), metavar="DIRECTORY",
              help="The kubelet's device-plugins directory (kubelet.sock).")
@click.option("--resource-name", "resource_names", multiple=True, metavar="KIND=NAME",
              help="Serve KIND as resource NAME (repeatable; default: the kind, e.g. nvidia.com/gpu).")
@click.option("--allocate", type=click.Choice(["both", "cdi"]), default="both", show_default=True,
              help="cdi: answer with CDI device names only; both: also devices, mounts and env for runtimes "
                   "without CDI.")
@click.option("--metrics-address", default="127.0.0.1:9400", show_default=True, metavar="HOST:PORT",
              help="HOST:PORT for /metrics, /healthz and /readyz (the DaemonSet: the node's address; "
                   "'' to turn them off).")
@click.option("--pod-uid", default=None, metavar="UID", callback=lambda _c, _p, v: _pod_uid(v),
              help="The agent's own pod's UID (the DaemonSet: the downward API's metadata.uid): its kubelet "
                   "sockets carry it, so a rolling update's two pods overlap on a node (docs/deploy.md).")
def device_plugin(plugin_dir: str, resource_names: tuple[str, ...], allocate: str, metrics_address: str,
                  pod_uid: str | None, **options: Any) -> None:
    """Kubernetes node agent: a kubelet device plugin per kind, with watch's health loop and specs."""
    from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions

    names: dict[str, str] = {}
    for item in resource_names:
        kind, sep, name = item.partition("=")
        if not sep or not kind or not name or "/" not in name:
            raise UsageError(f"--resource-name {item!r}: expected KIND=vendor.com/name")
        names[kind] = name
    _check_metrics_address(metrics_address)
    watch, node = _watch_options(**options)
    from devinject.deviceplugin.sharing import SharingConfig

    sharing = click.get_current_context().meta.get("devinject.sharing", SharingConfig())
    opts = PluginOptions(watch=watch, plugin_dir=plugin_dir, resource_names=names, fallback=allocate == "both",
                         metrics_address=metrics_address or None, sharing=sharing, pod_uid=pod_uid)
    stop = _stop_on_signals()
    DevicePluginAgent(opts, node=node).run(stop)
    stop.exit()


@cli.command("dra-driver")
@click.option("--config", metavar="FILE", is_eager=True, expose_value=False, callback=_load_config,
              help="YAML file of option values (e.g. the DaemonSet's ConfigMap); flags given win over it.")
@root_option
@state_dir_option
@profile_dir_option
@target_root_option
@driver_root_option
@nvml_option
@node_hook_option
@click.option("--hook-path", default=None, metavar="PATH",
              help="Absolute path of devinject for the claim specs' CDI hooks.")
@click.option("--kind", "kinds", multiple=True, metavar="KIND", help="Only this kind (repeatable).")
@click.option("--node-name", envvar="NODE_NAME", required=True, metavar="NAME",
              help="This node's name (env NODE_NAME).")
@click.option("--driver-name", default="dra.devinject.io", show_default=True, metavar="NAME",
              help="The DRA driver name.")
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Kubeconfig for the API server (default: the pod's service account).")
@click.option("--plugin-dir", default="/var/lib/kubelet/plugins", show_default=True, type=click.Path(file_okay=False),
              metavar="DIRECTORY",
              help="The kubelet's plugins directory (the DRA socket goes in <driver-name>/dra.sock).")
@click.option("--registry-dir", default="/var/lib/kubelet/plugins_registry", show_default=True,
              type=click.Path(file_okay=False), metavar="DIRECTORY",
              help="The kubelet's plugin registration directory.")
@click.option("--cdi-dir", default=DYNAMIC_SPEC_DIR, show_default=True, type=click.Path(file_okay=False),
              metavar="DIRECTORY", help="Where the claim-scoped CDI specs go.")
@click.option("--rescan", default=30.0, show_default=True, type=click.FloatRange(0.05, 3600),
              help="Seconds between rediscoveries (and slice updates; a health verdict is published at once).")
@click.option("--health", "health_mode", type=click.Choice(["auto", "check", "follow"]), default="auto",
              show_default=True,
              help="auto: run the node's health loop here unless another agent's (watch, device-plugin) runs on "
                   "the state dir, then follow its verdicts; check: always here; follow: never here.")
@click.option("--interval", default=10.0, show_default=True, type=float, help="Seconds between health checks (5-60).")
@click.option("--recheck", default=1.5, show_default=True, type=float,
              help="Seconds between re-checks of a failing device (1-2).")
@click.option("--threshold", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Consecutive failures (or passes) before a device is taken out (or put back).")
@click.option("--test-timings", is_flag=True, hidden=True, help="Lift the interval ranges (tests, benchmarks).")
@kernel_log_option
@click.option("--uevents/--no-uevents", default=True, show_default=True, help="Listen for kernel uevents.")
@click.option("--fatal-taint-effect", type=click.Choice(["NoSchedule", "NoExecute"]), default="NoSchedule",
              show_default=True,
              help="The taint effect of a fatal fault (Xid, AER fatal, gone): NoExecute also evicts the pods using "
                   "the device (the taint-eviction controller); other faults are always NoSchedule.")
@click.option("--metrics-address", default="127.0.0.1:9401", show_default=True, metavar="HOST:PORT",
              help="HOST:PORT for /metrics, /healthz and /readyz (the DaemonSet: the pod's address; '' to turn "
                   "them off).")
@click.option("--consumable-capacity", default="off", show_default=True, metavar="shares=N[,memory=Q|auto]",
              help="Publish each whole GPU with allowMultipleAllocations and shareable capacity "
                   "(DRAConsumableCapacity): at most N claims per GPU, and its memory (e.g. 80Gi; auto: what "
                   "NVML or sysfs states) for claims' capacity.requests (docs/sharing.md).")
@click.option("--nfd-features-dir", default=None, metavar="DIRECTORY",
              help="Write the node's labels for Node Feature Discovery there (its features.d, e.g. "
                   f"{NFD_FEATURES_DIR}), as the devices change.")
@click.option("--device-metadata/--no-device-metadata", default=False, show_default=True,
              help="Give each claim's containers its devices and their attributes (KEP-5304): a metadata.json "
                   "per request under --plugin-dir, mounted read-only at /var/run/kubernetes.io/"
                   "dra-device-attributes/... (docs/dra.md).")
@click.option("--pod-uid", default=None, metavar="UID", callback=lambda _c, _p, v: _pod_uid(v),
              help="The agent's own pod's UID (the DaemonSet: the downward API's metadata.uid): its kubelet "
                   "sockets carry it, so a rolling update's two pods overlap on a node (docs/deploy.md).")
def dra_driver(root: str, state_dir: str, profile_dirs: tuple[str, ...], target_root: str | None,
               driver_root: str | None, nvml: bool | None, node_hook: str | None, hook_path: str | None,
               kinds: tuple[str, ...], node_name: str, driver_name: str, kubeconfig: str | None, plugin_dir: str,
               registry_dir: str, cdi_dir: str, rescan: float, health_mode: str, interval: float, recheck: float,
               threshold: int, test_timings: bool, kernel_log: str, uevents: bool, fatal_taint_effect: str,
               metrics_address: str, consumable_capacity: str, nfd_features_dir: str | None,
               device_metadata: bool, pod_uid: str | None) -> None:
    """Kubernetes DRA kubelet plugin: ResourceSlices from discovery with the node's health loop (faults as
    device taints), claims prepared as CDI specs (docs/dra.md)."""
    from devinject.agent.watch import WatchOptions
    from devinject.cdi.names import vendor_problem
    from devinject.dra.driver import DraDriver, DraOptions
    from devinject.dra.publisher import SlicePublisher, api_client
    from devinject.linux.trusteddir import make_dirs, trusted_dir
    from devinject.specs.generate import GenerateOptions, default_hook_path

    if kubeconfig is not None:
        _check_kubeconfig(kubeconfig)
    problem = vendor_problem(driver_name)
    if problem or driver_name != driver_name.lower():
        raise UsageError(f"--driver-name {driver_name!r}: {problem or 'must be lower case'} (a DNS subdomain)")
    _check_metrics_address(metrics_address)
    from devinject.dra.capacity import CapacityError, parse_capacity_sharing

    try:
        capacity = parse_capacity_sharing(consumable_capacity)
    except CapacityError as err:
        raise UsageError(err.message) from None
    _check_roots(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log)
    _check_timings(interval, recheck, rescan, test_timings)
    trusted_dir(state_dir)
    make_dirs(cdi_dir)
    hook_path = _node_hook(root, node_hook, hook_path, target_root)
    gen = GenerateOptions(root=root, kinds=kinds, hook_path=hook_path or default_hook_path(), profile_dirs=profile_dirs,
                          node_hook=_bundle_command(node_hook, hook_path), target_root=target_root,
                          driver_root=driver_root, nvml=nvml)
    gen.check()
    watch = WatchOptions(generate=gen, state_dir=state_dir, interval=interval, recheck=recheck, threshold=threshold,
                         rescan=rescan, kernel_log=kernel_log, uevents=uevents, specs=False)
    opts = DraOptions(generate=gen, node_name=node_name, driver=driver_name, plugin_dir=plugin_dir,
                      registry_dir=registry_dir, cdi_dir=cdi_dir, state_dir=state_dir, rescan=rescan,
                      health=health_mode, watch=watch, fatal_effect=fatal_taint_effect,
                      metrics_address=metrics_address or None, capacity=capacity,
                      nfd_features_dir=nfd_features_dir, device_metadata=device_metadata, pod_uid=pod_uid)
    stop = _stop_on_signals()
    DraDriver(opts, SlicePublisher(api_client(kubeconfig), driver_name, node_name, watch=True)).run(stop)
    stop.exit()


def _check_kubeconfig(path: str) -> None:
    """--kubeconfig FILE is a kubeconfig (a mapping with clusters, contexts and users lists), said in one line
    before the API client reads it."""
    import yaml

    from devinject.discovery.profiles import yaml_problem

    try:
        with open(path, "rb") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise UsageError(f"--kubeconfig {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--kubeconfig {yaml_problem(path, err)}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(key), list) for key in ("clusters", "users")):
        raise UsageError(f"--kubeconfig {path}: not a kubeconfig (expected a mapping with clusters and users lists)")


@cli.command("events")
@click.argument("device", required=False)
@root_option
@state_dir_option
@profile_dir_option
@kind_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def events_command(device: str | None, root: str, state_dir: str, profile_dirs: tuple[str, ...],
                   kinds: tuple[str, ...], as_json: bool) -> None:
    """The last transitions per device (all devices, or DEVICE's: its key, or any name of it on the node
    under --root)."""
    node = _node(root=root, state_dir=state_dir, profile_dirs=profile_dirs)
    _check_kinds(node, kinds)
    found = [e for e in node.events(device) if not kinds or e.kind in kinds]
    if as_json:
        click.echo(json.dumps([e.to_json() for e in found], indent=2))
        return
    if not found and not os.path.isdir(state_dir):
        note(f"no events: {state_dir} does not exist (no agent or hook has run with this --state-dir)")
    elif not found:
        note("no events")
    for index, event in enumerate(found):
        if index == 0 or found[index - 1].name != event.name:
            click.echo(event.name)
        extra = "; ".join(event.reasons) or str(dict(event.details).get("health", ""))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.time))
        click.echo(f"  {stamp}  {event.event:10} {extra}".rstrip())


@cli.command("put-back")
@click.argument("device")
@root_option
@state_dir_option
@profile_dir_option
@kernel_log_option
def put_back(device: str, root: str, state_dir: str, profile_dirs: tuple[str, ...], kernel_log: str) -> None:
    """Clear DEVICE's sticky verdicts (AER fatal errors, fatal Xids): its AER totals as they read now become
    its baseline; `watch`/`device-plugin` puts it back once its checks pass."""
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log)
    from devinject.agent.healthstate import request_put_back

    key, accepted = request_put_back(root, state_dir, device, profile_dirs, node=node)
    totals = ", ".join(f"{fn} fatal {f} non-fatal {n}" for fn, (f, n) in sorted(accepted.items()))
    accepting = f" (AER totals accepted: {totals})" if accepted else ""  # a channel has no AER counters
    click.echo(f"{key}: put-back requested{accepting}; the agent puts it back after "
               "--threshold passing checks")


@cli.command()
@click.argument("device", required=False)
@root_option
@state_dir_option
@profile_dir_option
@kind_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def who(device: str | None, root: str, state_dir: str, profile_dirs: tuple[str, ...], kinds: tuple[str, ...],
        as_json: bool) -> None:
    """Processes holding device nodes open (pid, command, container if known)."""
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir)
    _check_kinds(node, kinds)
    rows = [r for r in node.holders(device) if not kinds or r.kind in kinds]
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2))
        return
    if not rows:
        note("no process holds a device node")
    from devinject.agent.mps import MpsDaemons
    from devinject.nodestate.profilefacts import time_slicing

    sliced = time_slicing(state_dir) if os.path.isdir(state_dir) else {}
    mps = MpsDaemons(state_dir).running() if os.path.isdir(state_dir) else {}
    for r in rows:
        held = r.holder
        sharing = ("  (MPS)" if r.pci_address in mps else
                   f"  (time-sliced {sliced[r.kind]} ways)" if r.kind in sliced else "")
        click.echo(f"{r.name:32} {held.node or '-':24} pid {held.pid:<8} {held.command or '?':16} "
                   f"{held.container or '-'}{sharing}")


@cli.command("create-dev-char-links")
@root_option
@click.option("--dry-run", is_flag=True, help="Print the links instead of creating them.")
@profile_dir_option
def create_dev_char_links(root: str, dry_run: bool, profile_dirs: tuple[str, ...]) -> None:
    """Create /dev/char/MAJ:MIN links for discovered nodes that udev did not make (systemd reload caveat)."""
    from devinject.linux.trusteddir import trusted_dir

    for link, target in _node(root=root, profile_dirs=profile_dirs).dev_char_links():
        if dry_run:
            click.echo(f"{link} -> {target}")
            continue
        trusted_dir(os.path.dirname(link), what="/dev/char directory")  # 0755 whatever the umask, or refused
        try:
            os.symlink(target, link)
        except FileExistsError:
            continue
        except OSError as err:
            raise DevinjectError(f"{link}: cannot create: {err.strerror}") from None
        note(f"{link} -> {target}")


@cli.group()
def runtime() -> None:
    """The container runtime's side of CDI: turn it on (configure)."""


@runtime.command("configure")
@click.option("--runtime", "runtime_name", required=True, type=click.Choice(["containerd", "crio", "docker", "podman",
                                                                             "runc"]),
              help="The runtime to configure.")
@click.option("--config", "config", default=None, metavar="FILE",
              help="Its main config file [default: the runtime's own, e.g. /etc/containerd/config.toml].")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIRECTORY",
              help=f"A CDI spec directory it reads (repeatable) [default: {STATIC_SPEC_DIR}, {DYNAMIC_SPEC_DIR}].")
@click.option("--runtime-version", default=None, metavar="VERSION",
              help="Its version (1.7, 2.3.4, 27.1) [default: asked of its binary on PATH when --root is /].")
@click.option("--config-dir", default=None, metavar="DIRECTORY",
              help="CRI-O: the drop-in directory it reads (its --config-dir) [default: /etc/crio/crio.conf.d, "
                   "whatever --config says].")
@click.option("--root", "host_root", default="/", show_default=True, metavar="DIRECTORY",
              help="The host's / (the agent's /host): --config, --config-dir and the config's imports are "
                   "read and written under it, as the runtime names them.")
@click.option("--dry-run", is_flag=True, help="Print the change as a diff; write nothing.")
@click.option("--revert", is_flag=True, help="Take devinject's change back.")
def runtime_configure(runtime_name: str, config: str | None, spec_dirs: tuple[str, ...], runtime_version: str | None,
                      config_dir: str | None, host_root: str, dry_run: bool, revert: bool) -> None:
    """Turn CDI on in the runtime and point it at the spec dirs (a drop-in file where it reads them).

    Idempotent; an admin's other settings and comments stay. containerd 1.6 and runc apply no CDI: use
    install-hook there."""
    from devinject.core.paths import DEFAULT_SPEC_DIRS
    from devinject.runtimes.config import apply, plan_configure

    if config_dir is not None and runtime_name != "crio":
        raise UsageError("--config-dir: CRI-O's drop-in directory; only with --runtime crio")
    plan = plan_configure(runtime_name, config=config, spec_dirs=spec_dirs or DEFAULT_SPEC_DIRS,
                          version=runtime_version, revert=revert, root=host_root, config_dir=config_dir)
    if not plan.changes:
        note(f"{runtime_name}: {'nothing of devinject to take back' if revert else 'already configured'}")
        return
    if dry_run:
        click.echo("".join(change.diff() for change in plan.changes), nl=False)
        return
    for line in apply(plan):
        note(line)
    for line in plan.notes:
        note(line)


@cli.command()
@click.argument("device", required=False)
@root_option
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIRECTORY",
              help=f"A CDI spec directory to look in (repeatable) [default: {STATIC_SPEC_DIR}, {DYNAMIC_SPEC_DIR}].")
@click.option("--runtime", "runtime_name", default=None,
              type=click.Choice(["containerd", "crio", "docker", "podman", "runc"]),
              help="The runtime that starts the containers [default: the one whose configuration is on the node].")
@click.option("--runtime-version", default=None, metavar="VERSION",
              help="The runtime's version [default: asked of its binary when --root is /].")
@state_dir_option
@profile_dir_option
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Kubeconfig for the API server: check the node's ResourceSlices (the slice link) [default: "
                   "$KUBECONFIG, else the pod's service account, else none: the link is left out].")
@click.option("--node-name", envvar="NODE_NAME", default=None, metavar="NAME",
              help="This node's name in the API (env NODE_NAME) [default: the host name, in lower case].")
@click.option("--driver-name", default="dra.devinject.io", show_default=True, metavar="NAME",
              help="The DRA driver whose slices are checked.")
@click.option("--dra-metrics", default="127.0.0.1:9401", show_default=True, metavar="HOST:PORT",
              help="The DRA driver's /metrics, read for the publishes it counts as failed ('' not to; the "
                   "shipped DaemonSet serves it on the node's IP).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@nvml_option
@driver_root_option
def doctor(device: str | None, root: str, spec_dirs: tuple[str, ...], runtime_name: str | None,
           runtime_version: str | None, state_dir: str, profile_dirs: tuple[str, ...], kubeconfig: str | None,
           node_name: str | None, driver_name: str, dra_metrics: str, as_json: bool, nvml: bool | None,
           driver_root: str | None) -> None:
    """Walk each device's chain to a container (pci, driver, nodes, libraries, spec, runtime, ledger, health,
    kubelet, and with an API server its ResourceSlice) and name the first broken link and its fix; exit 0
    only when every link holds.

    DEVICE: an index or CDI name (nvidia.com/gpu=0), a UUID, a PCI address or kind=PCI address."""
    from devinject.core.paths import DEFAULT_SPEC_DIRS
    from devinject.doctor import DoctorOptions, diagnose, render, slice_api

    if kubeconfig is not None:
        _check_kubeconfig(kubeconfig)
    import socket

    if dra_metrics and not dra_metrics.rpartition(":")[2].isdigit():
        raise UsageError(f"--dra-metrics {dra_metrics!r}: expected HOST:PORT")
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, nvml=nvml, driver_root=driver_root)
    api = slice_api(kubeconfig)
    found = diagnose(node, device, DoctorOptions(
        spec_dirs=spec_dirs or DEFAULT_SPEC_DIRS, runtime=runtime_name, runtime_version=runtime_version, api=api,
        node_name=node_name or socket.gethostname().lower(), driver=driver_name, metrics_address=dra_metrics or None))
    if as_json:
        click.echo(json.dumps([d.to_json() for d in found], indent=2))
    elif found:
        click.echo(render(found), nl=False)
    if not found:  # nothing to walk is the first link broken
        note(node.why_no_devices(), error=True)
    sys.exit(0 if found and all(d.ok for d in found) else 1)


@cli.command()
@root_option
@profile_dir_option
@click.option("--write", "directory", default=None, metavar="DIRECTORY",
              help="Write the feature file into DIRECTORY (NFD's features.d) instead of printing it.")
def labels(root: str, profile_dirs: tuple[str, ...], directory: str | None) -> None:
    """The node's labels for Node Feature Discovery's local source: per kind its count, product, driver
    version, partitions and NUMA nodes, under devinject.io/ (watch and device-plugin write them with
    --nfd-features-dir)."""
    from devinject.agent.nfd import FEATURE_FILE, features, write_features

    node = _node(root=root, profile_dirs=profile_dirs)
    lines = features(node.host, node.devices())
    if directory is None:
        click.echo("\n".join(lines))
        return
    if not os.path.isdir(directory):
        raise UsageError(f"--write {directory}: no such directory")
    try:
        written = write_features(directory, lines)
    except OSError as err:
        raise DevinjectError(f"{directory}: cannot write the feature file: {err.strerror}") from None
    note(f"{'wrote' if written else 'unchanged:'} {os.path.join(directory, FEATURE_FILE)}")
