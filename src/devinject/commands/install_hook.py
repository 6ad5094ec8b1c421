"""`devinject install-hook`."""

from __future__ import annotations

import os
from pathlib import Path

import click

from devinject.commands.group import cli, note
from devinject.core.errors import UsageError
from devinject.core.paths import (
    HOOK_SOCKET,
)


@cli.command("install-hook")
@click.option("--hooks-dir", default=None, metavar="DIRECTORY",
              help="An existing hooks.d directory [default: /etc/containers/oci/hooks.d, made when missing].")
@click.option("--executable", default=None, metavar="FILE",
              help="Absolute path of the devinject program to run [default: this installation's interpreter on "
                   "its fast hook launcher].")
@click.option("--env-requests", is_flag=True,
              help="Run for every container so env requests (NVIDIA_VISIBLE_DEVICES, ...) work too.")
@click.option("--poststop", is_flag=True,
              help="Also run at container delete, releasing devices in the ledger at once (without it they are "
                   "freed on the ledger's next access, once the container's process is gone).")
@click.option("--server", "server_socket", default=None, metavar="SOCKET",
              help=f"The hook server's socket the hook hands container starts to [default: {HOOK_SOCKET}].")
@click.option("--runc-snippet", is_flag=True, help="Print the runc config.json hooks snippet instead.")
@click.option("--server-unit", is_flag=True,
              help="Also write the systemd unit of the hook server on that socket, run by this installation.")
@click.option("--unit-dir", default=None, metavar="DIRECTORY",
              help="Where --server-unit writes it [default: /etc/systemd/system].")
def install_hook(hooks_dir: str | None, executable: str | None, env_requests: bool, poststop: bool,
                 server_socket: str | None, runc_snippet: bool, server_unit: bool, unit_dir: str | None) -> None:
    """Install the OCI hook for CRI-O and podman (hooks.d 1.0.0)."""
    from devinject.hook.client import DEFAULT_SOCKET, server_answers
    from devinject.install.hooksd import (
        DEFAULT_HOOKS_DIR,
        DEFAULT_UNIT_DIR,
        HOOK_FILE,
        SERVER_UNIT,
        hook_command,
        hooks_d_entry,
        pod_annotation_passthrough,
        render,
        runc_hooks,
    )
    from devinject.install.hooksd import server_unit as render_server_unit
    from devinject.linux.trusteddir import write_file

    command = hook_command(executable and os.path.abspath(executable))
    if not os.access(command[0], os.X_OK):
        raise UsageError(f"--executable {command[0]}: not an executable file")
    server = os.path.abspath(server_socket) if server_socket else DEFAULT_SOCKET
    if runc_snippet:
        click.echo(render(runc_hooks(command, poststop=poststop, server=server)), nl=False)
    else:
        directory = Path(hooks_dir or DEFAULT_HOOKS_DIR)
        if hooks_dir is not None and not directory.is_dir() and not directory.absolute().parent.is_dir():
            # a typo'd path no runtime reads: only its last component is made, as `mkdir` would
            raise UsageError(f"--hooks-dir {hooks_dir}: no such directory as {directory.absolute().parent} (the "
                             "runtime reads hooks from a directory it is configured with: create that one first)")
        target = directory / HOOK_FILE  # what the runtime runs as root: written as trusteddir writes root's files
        write_file(str(target), render(hooks_d_entry(command, env_requests=env_requests, poststop=poststop,
                                                     server=server)).encode(), what="hooks.d file", sync=True)
        note(f"wrote {target}")
    for line in pod_annotation_passthrough():
        note(f"warning: {line}")
    if server_unit:
        unit = Path(unit_dir or DEFAULT_UNIT_DIR) / SERVER_UNIT
        write_file(str(unit), render_server_unit(command, server).encode(), what="systemd unit", sync=True)
        note(f"wrote {unit}; start it: systemctl daemon-reload && systemctl enable --now {SERVER_UNIT}")
    elif not server_answers(server):  # the hook still works: in-process, ~4 ms slower on each container start
        note(f"note: no hook server answers at {server}: each container start will load the hook itself; "
             f"run `devinject hook-server --socket {server}`, or install its unit (--server-unit)")
