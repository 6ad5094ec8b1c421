"""The `devinject` click group: its global options, the one way to the user's stderr (`note`) and the one
line a library error becomes."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from devinject import __version__
from devinject.core.errors import DevinjectError

log = logging.getLogger("devinject")


# long-running: `kubectl logs` / the journal is how they are read
AGENT_COMMANDS = ("watch", "device-plugin", "dra-driver")


def note(text: str, *, error: bool = False) -> None:
    """A line for the user on stderr (what was written, what was not found, a warning; or, `error`, a problem
    found). The one place that decides what -q keeps: errors only, as it keeps the log at error level."""
    ctx = click.get_current_context(silent=True)
    if error or ctx is None or not ctx.find_root().params.get("quiet"):
        click.echo(text, err=True)


class _Group(click.Group):
    """Turns library errors into one line on stderr and exit 1; no tracebacks for users."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DevinjectError as err:
            hint = f" ({err.hint})" if err.hint else ""
            click.echo(f"devinject: error: {err.message}{hint}", err=True)
            ctx.exit(err.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="devinject")
@click.option("-v", "--verbose", count=True,
              help="More logging (repeat for debug); watch and device-plugin log at info already.")
@click.option("-q", "--quiet", is_flag=True,
              help="Errors only on stderr: no log below error, no 'wrote ...' or 'no devices found' lines.")
def cli(verbose: int, quiet: bool) -> None:
    """Discover accelerators, write CDI specs, and inject devices into containers."""
    if click.get_current_context().invoked_subcommand in AGENT_COMMANDS:
        verbose = max(verbose, 1)  # a node agent's log is what it did: at info unless -q
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="devinject: %(levelname)s: %(message)s", stream=sys.stderr)
