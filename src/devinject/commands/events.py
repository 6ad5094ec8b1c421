"""`devinject events`: the last transitions per device."""

from __future__ import annotations

import json
import os
import time

import click

from devinject.commands.common import _check_kinds, _node
from devinject.commands.group import cli, note
from devinject.commands.options import (
    device_state_options,
)


@cli.command("events")
@device_state_options
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
