"""`devinject hook-server`."""

from __future__ import annotations

import click

from devinject.commands.group import cli
from devinject.core.errors import DevinjectError
from devinject.core.paths import (
    HOOK_SOCKET,
)


@cli.command("hook-server")
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help=f"Where to listen [default: {HOOK_SOCKET}, where the hook looks].")
def hook_server(socket_path: str | None) -> None:
    """Serve `devinject hook` and the specs' `cdi-hook` from a resident process: each container start skips
    the hook's imports.

    The hook hands its invocation over when the socket answers and runs in-process otherwise."""
    from devinject.hook.client import DEFAULT_SOCKET
    from devinject.hook.server import serve

    try:
        serve(socket_path or DEFAULT_SOCKET)
    except OSError as err:
        raise DevinjectError(f"{socket_path or DEFAULT_SOCKET}: cannot serve: {err.strerror or err}") from None
    except KeyboardInterrupt:
        pass
