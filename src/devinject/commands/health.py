"""`devinject health`."""

from __future__ import annotations

import json
import sys

import click

from devinject.commands.common import _device_order, _missing_kinds, _node
from devinject.commands.group import cli, note
from devinject.commands.options import (
    inventory_options,
)
from devinject.core.errors import DevinjectError


@cli.command()
@inventory_options
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
