"""What several commands do alike: the node they were pointed at, the specs' hook path, `--kind`, their
checks of options."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from devinject.core.errors import DevinjectError, UsageError

if TYPE_CHECKING:
    from devinject.api import LiveNode
    from devinject.specs.hooks import HookCommand


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
          driver_root: str | None = None) -> LiveNode:
    """The node a command was pointed at (devinject.api), its roots checked once before it reads anything: a
    wrong one is one line naming it (discovery/roots.py). The kernel log may be missing only when it was not
    asked for."""
    from click.core import ParameterSource

    from devinject.api import LiveNode

    source = click.get_current_context().get_parameter_source("kernel_log")
    return LiveNode(root, target_root=target_root, profile_dirs=profile_dirs, state_dir=state_dir,
                kernel_log=kernel_log, kernel_log_explicit=source not in (None, ParameterSource.DEFAULT),
                nvml=nvml, driver_root=driver_root)


def _check_roots(*, root: str = "/", profile_dirs: tuple[str, ...] = (), state_dir: str | None = None,
                 kernel_log: str | None = None) -> None:
    """The roots of a command that reads no devices here (install-node-hook), checked as _node checks them."""
    _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log)


def _missing_kinds(asked: tuple[str, ...], found: set[str]) -> tuple[str, ...]:
    """The kinds of `--kind` a command found nothing of."""
    return tuple(kind for kind in dict.fromkeys(asked) if kind not in found)


def _check_kinds(node: LiveNode, kinds: tuple[str, ...]) -> None:
    """`--kind` of a command whose rows are not the devices themselves (who, events, doctor): a kind the node
    has no device of is one line why, exit 1, as for `list`."""
    if kinds:
        found = {d.profile.kind for d in node.devices()} | {c.profile.kind for c in node.channels()}
        missing = _missing_kinds(kinds, found)
        if missing:
            raise DevinjectError(node.why_no_devices(missing))


def _device_order(record: Any) -> tuple[str, str, tuple[int | str, ...]]:
    """How list and health order devices: by kind, then PCI address (a channel, which has none, by number)."""
    import re

    name = tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", record.name))
    return record.kind, record.pci_address or "", name


def _check_metrics_address(address: str) -> None:
    if address:
        _, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise UsageError(f"--metrics-address {address!r}: expected HOST:PORT")


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
