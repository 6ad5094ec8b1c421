"""Console entry point. `hook` and `cdi-hook` take a lean path that never imports click or yaml:
they run on every container start."""

from __future__ import annotations

import sys

LEAN_COMMANDS = ("hook", "cdi-hook")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in LEAN_COMMANDS:
        if args[0] == "hook":  # cdi-hook runs inside the container's namespace: never handed over
            from devinject.hook.client import run_via_server

            status = run_via_server(args)
            if status is not None:
                return status
        from devinject.hook.main import main as hook_main

        return hook_main(args)
    from devinject.cli import run

    return run(args)
