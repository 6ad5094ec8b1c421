"""`devinject cdi list`: the names a runtime resolves from the spec dirs."""

from __future__ import annotations

import json
import sys

import click

from devinject.commands.group import cli, note
from devinject.core.paths import (
    DYNAMIC_SPEC_DIR,
    STATIC_SPEC_DIR,
)


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
