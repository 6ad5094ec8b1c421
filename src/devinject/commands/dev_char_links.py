"""`devinject create-dev-char-links`."""

from __future__ import annotations

import os

import click

from devinject.commands.common import _node
from devinject.commands.group import cli, note
from devinject.commands.options import profile_dir_option, root_option
from devinject.core.errors import DevinjectError


@cli.command("create-dev-char-links")
@root_option
@click.option("--dry-run", is_flag=True, help="Print the links instead of creating them.")
@profile_dir_option
def create_dev_char_links(root: str, dry_run: bool, profile_dirs: tuple[str, ...]) -> None:
    """Create /dev/char/MAJ:MIN links for discovered nodes that udev did not make (systemd reload caveat)."""
    from devinject.linux.trusteddir import trusted_dir

    for link, target in _node(root=root, profile_dirs=profile_dirs).dev_char_links():
        if dry_run:
            click.echo(f"{link} -> {target}")
            continue
        trusted_dir(os.path.dirname(link), what="/dev/char directory")  # 0755 whatever the umask, or refused
        try:
            os.symlink(target, link)
        except FileExistsError:
            continue
        except OSError as err:
            raise DevinjectError(f"{link}: cannot create: {err.strerror}") from None
        note(f"{link} -> {target}")
