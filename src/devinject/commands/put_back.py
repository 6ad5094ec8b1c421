"""`devinject put-back`."""

from __future__ import annotations

import click

from devinject.commands.common import _node
from devinject.commands.group import cli
from devinject.commands.options import kernel_log_option, profile_dir_option, root_option, state_dir_option


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
