"""The one way in: the console script (`main`) and the hook launcher (`launch`, hook/launcher.py) route
every invocation here. A `hook`, and a `cdi-hook` with something to make, is handed to the hook server when
one takes it (hook/client.py), else it runs in-process; `hook` and `cdi-hook` take a lean path that never
imports click or yaml (they run on every container start); every other command is the click CLI's.

The launcher imports this module before a served hook is handed over, in an interpreter started with -S:
it imports only what is built in (`sys`, no `from __future__`, itself a module) until the route is known.
"""

import sys

LEAN_COMMANDS = ("hook", "cdi-hook")


def worth_serving(args: list[str]) -> bool:
    """Whether to offer this invocation to a server: every `hook`; a `cdi-hook` with a link (a device's too), a
    library folder or an application profile's GPU to make (one with nothing to do returns at once in-process,
    and `--help` is printed here)."""
    if args[:1] == ["hook"]:
        return True
    if args[:1] != ["cdi-hook"]:
        return False
    work = False
    for arg in args[1:]:
        if arg in ("-h", "--help"):
            return False
        work = work or arg.startswith(("--link", "--device-link", "--folder", "--application-profile"))
    return work


def main(argv: list[str] | None = None, *, site_dirs: bool = False) -> int:
    """Run one invocation and return its exit status. `site_dirs`: the interpreter runs without `site` (the
    launcher), so the package directories it would have added are added before anything runs in-process
    (yaml on a spec-cache miss, pyroute2 for network devices, click for the CLI)."""
    args = sys.argv[1:] if argv is None else argv
    if worth_serving(args):
        from devinject.hook.client import run_via_server

        status = run_via_server(args)
        if status is not None:
            return status
    if site_dirs and args[:1] != ["cdi-hook"]:  # a cdi-hook imports no third-party package
        from devinject.hook.sitedirs import package_dirs

        sys.path += package_dirs()
    if args[:1] == ["cdi-hook"]:  # its own module: the OCI hook's is not loaded for it
        from devinject.hook.cdihook import main as cdi_hook_main

        return cdi_hook_main(args[1:])
    if args[:1] and args[0] in LEAN_COMMANDS:
        from devinject.hook.main import main as hook_main

        return hook_main(args)
    from devinject.cli import run

    return run(args)


def launch(argv: list[str]) -> None:
    """The launcher's whole run: `main` without `site`, then an exit without the interpreter's teardown of
    every loaded module (~1.7 ms on each container start): everything the hook writes is written and closed
    by then (its log line, the spec cache)."""
    import posix

    status = main(argv, site_dirs=True)
    sys.stdout.flush()
    sys.stderr.flush()
    posix._exit(status)
