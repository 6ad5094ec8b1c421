"""`devinject hook` and `devinject cdi-hook` as `--help` lists them (entry.py runs them without click)."""

from __future__ import annotations

import click

from devinject.commands.group import cli


def _lean_command(name: str, short: str, summary: str) -> None:
    """`hook` and `cdi-hook` run before click is imported (entry.py): listed here so that `devinject --help`
    names them; their --help is the hook's own. Click runs them only when cli.run is called directly."""

    @cli.command(name, short_help=short, help=summary, add_help_option=False,
                 context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.pass_context
    def lean(ctx: click.Context) -> None:
        from devinject.hook.main import main as hook_main

        ctx.exit(hook_main([name, *ctx.args]))


_lean_command("hook", "OCI hook: inject the devices a container asks for.",
              "The OCI hook (prestart, createRuntime, poststop): give a container the CDI devices it asks for, "
              "with cgroup grants and the device ledger (see install-hook).")


_lean_command("cdi-hook", "The specs' hooks: symlinks and the linker cache.",
              "The generated specs' createContainer hooks: create-symlinks, update-ldcache, links-and-ldcache "
              "(both in one process).")
