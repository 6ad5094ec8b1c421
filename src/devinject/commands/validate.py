"""`devinject validate`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from devinject.commands.group import cli, note


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
