"""The entry of the node hook bundle (`<bundle>/bin/devinject`, installed by `devinject install-node-hook`):
what a runtime that applies CDI itself runs on the host for a spec's createContainer hooks. It runs `cdi-hook`
and `--version` only: the bundle carries just the standard library those import (install/nodehook.py measures
it), so everything else is refused in one line rather than failing on a missing module. Lean, as the hook."""

import sys

USAGE = ("devinject: error: the node hook runs only `cdi-hook create-symlinks|update-ldcache|links-and-ldcache ...` "
         "and `--version` (the other commands are the agent's: run them in its image)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        from devinject import __version__

        print(f"devinject, version {__version__}")
        return 0
    if args[:1] == ["cdi-hook"]:
        from devinject.hook.cdihook import main as cdi_hook_main

        return cdi_hook_main(args[1:])
    print(USAGE, file=sys.stderr)
    return 2


def run() -> None:
    """The launcher's whole run: `main`, then an exit without the interpreter's teardown of every loaded module
    (as entry.launch): everything the cdi-hook writes is written and closed by then."""
    import posix

    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    posix._exit(status)
