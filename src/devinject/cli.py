"""The `devinject` command line: click parsing and exit codes only; the work is in the library. Each command is
a module of `devinject.commands`; importing them here puts them on the group."""

from __future__ import annotations

from devinject.commands import (  # noqa: F401  (each module registers its command on the group)
    cdi,
    dev_char_links,
    device_plugin,
    doctor,
    dra_driver,
    events,
    generate,
    health,
    hook_server,
    install_hook,
    install_node_hook,
    labels,
    lean,
    list_devices,
    put_back,
    runtime,
    topo,
    validate,
    watch,
    who,
)
from devinject.commands.group import cli, note
from devinject.commands.options import node_hook_option

__all__ = ["cli", "node_hook_option", "note", "run"]


def run(args: list[str]) -> int:
    try:
        cli.main(args=args, prog_name="devinject", standalone_mode=True)
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    return 0
