"""`devinject who`."""

from __future__ import annotations

import json
import os

import click

from devinject.commands.common import _check_kinds, _node
from devinject.commands.group import cli, note
from devinject.commands.options import (
    device_state_options,
)


@cli.command()
@device_state_options
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
