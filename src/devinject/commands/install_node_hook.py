"""`devinject install-node-hook`."""

from __future__ import annotations

import click

from devinject.commands.common import _check_roots
from devinject.commands.group import cli, note
from devinject.commands.options import RenamedOption, root_option
from devinject.core.errors import DevinjectError


@cli.command("install-node-hook")
@root_option
@click.option("--output-dir", "directory", cls=RenamedOption, renamed_from=("--dir",), default="/opt/devinject/hook",
              show_default=True, metavar="DIRECTORY",
              help="Where the bundle goes, as the host names it (its parent must be writable here).")
@click.option("--check", is_flag=True, help="Install nothing: say whether the node hook there is ready (exit 1 "
                                            "and why when it is not).")
@click.option("--force", is_flag=True, help="Rebuild and replace it even when the one there is current.")
def install_node_hook(root: str, directory: str, check: bool, force: bool) -> None:
    """Install this devinject onto the host as a self-contained CDI hook (its interpreter, loader, libraries and
    modules: the node needs only /bin/sh) and print the --hook-path for specs; see docs/node-hook.md."""
    _check_roots(root=root)
    from devinject.install.nodehook import hook_path, in_root, install_node_hook, node_hook_ready

    if check:
        problem = node_hook_ready(root, directory)
        if problem:
            raise DevinjectError(problem)
        click.echo(hook_path(directory))
        return
    done = install_node_hook(root, directory, force=force)
    what = "installed" if done.changed else "already installed and current:"
    note(f"{what} {in_root(root, directory)} ({done.files} files, {done.size / 2**20:.1f} MiB); it runs")
    click.echo(done.hook_path)
