"""`devinject watch`."""

from __future__ import annotations

from typing import Any

from devinject.commands.agentloop import _stop_on_signals, _watch_options, watch_options
from devinject.commands.group import cli


@cli.command()
@watch_options
def watch(**options: Any) -> None:
    """Keep the CDI specs true to the hardware: rescan on hot-plug, take out unhealthy devices."""
    from devinject.agent.watch import Watcher

    opts, node = _watch_options(**options)
    stop = _stop_on_signals()
    Watcher(opts, node=node).run(stop)
    stop.exit()
