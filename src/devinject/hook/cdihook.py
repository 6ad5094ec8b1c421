"""`devinject cdi-hook` (the specs' CDI createContainer hook): the links, the linker cache and the application
profile of the container's GPUs, made in the container's mount namespace before pivot_root.

Apart from the OCI hook (hook/main.py): a CDI runtime runs it on every start of a container given a device,
in a fresh interpreter when no hook server takes it, so it imports only what it needs, and no `os`
(tests/unit/test_cdi_hook_lean.py holds its imports). Errors are one line on stderr starting
`devinject: error:` and a non-zero exit; nothing goes to stdout but --help.
"""

import sys

from devinject.core.errors import DevinjectError
from devinject.hook import fastjson


def run_cdi_hook(args: list[str], stdin_fd: int = 0) -> list[str]:
    """A CDI createContainer hook: already inside the container's mount namespace, before pivot_root. One with
    nothing to make (no link, device link, library directory or application profile's GPU) returns before it
    reads the container's state; one whose device links and GPUs name none of the container's devices, and
    nothing else, right after."""
    from devinject.hook.plan import Plan, device_links, gpu_minors, parse_cdi_hook, parse_forward_compat, parse_link

    _, values = parse_cdi_hook(args)
    links = tuple(dict.fromkeys(parse_link(v) for v in values["--link"]))
    folders = tuple(dict.fromkeys(v for v in values["--folder"] if v.startswith("/")))
    compat = tuple(dict.fromkeys(parse_forward_compat(v) for v in values["--forward-compat"]))
    if not links and not folders and not values["--device-link"] and not values["--application-profile"]:
        return []
    from devinject.hook.executor import Executor
    from devinject.hook.state import given_char_minors, given_devices, load_bundle, parse_state, read_stdin

    bundle = load_bundle(parse_state(read_stdin(stdin_fd)))
    if values["--device-link"]:
        links += tuple(s for s in device_links(values["--device-link"], given_devices(bundle)) if s not in links)
    minors: tuple[int, ...] = ()
    if values["--application-profile"]:
        minors, dropped = gpu_minors(values["--application-profile"], given_char_minors(bundle))
        for warning in dropped:
            print(f"devinject: warning: {warning}", file=sys.stderr)
    if not links and not folders and not minors:
        return []  # none of the devices whose links or GPUs the spec names is in this container
    return Executor(bundle.rootfs).apply(Plan(links=links, ldcache_folders=folders, forward_compat=compat,
                                              gpu_minors=minors))


def main(args: list[str]) -> int:
    """`cdi-hook ARGS`: 0 when done, 1 with one line for what stopped it, 2 for an internal error."""
    fastjson.install()  # the hook's JSON codec: the standard one costs imports on every start
    try:
        if any(arg in ("-h", "--help") for arg in args):  # no flag's value is either (not a path, no ::)
            from devinject.hook.plan import CDI_HOOK_COMMANDS, cdi_hook_usage

            if args[0] in ("-h", "--help", *CDI_HOOK_COMMANDS):  # else: run_cdi_hook names the unknown one
                print(cdi_hook_usage(args[0]))
                return 0
        run_cdi_hook(args)
        return 0
    except DevinjectError as err:
        print(f"devinject: error: {err.message}", file=sys.stderr)
        return 1
    except Exception as err:
        print(f"devinject: error: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
