"""`devinject runtime configure`: CDI on in a container runtime."""

from __future__ import annotations

import click

from devinject.commands.group import cli, note
from devinject.core.errors import UsageError
from devinject.core.paths import (
    DYNAMIC_SPEC_DIR,
    STATIC_SPEC_DIR,
)
from devinject.runtimes.names import RUNTIMES


@cli.group()
def runtime() -> None:
    """The container runtime's side of CDI: turn it on (configure)."""


@runtime.command("configure")
@click.option("--runtime", "runtime_name", required=True, type=click.Choice(RUNTIMES),
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
@click.option("--host-root", "--root", "host_root", default="/", show_default=True, metavar="DIRECTORY",
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
