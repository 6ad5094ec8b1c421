"""What the node agents share (watch, device-plugin, dra-driver): the health loop's options and their
stop on a signal."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from devinject.commands import options
from devinject.commands.common import (
    _bundle_command,
    _node,
    _node_hook,
)
from devinject.core.errors import UsageError
from devinject.core.paths import (
    DYNAMIC_SPEC_DIR,
    NFD_FEATURES_DIR,
    STATIC_SPEC_DIR,
)

if TYPE_CHECKING:
    from devinject.agent.watch import WatchOptions
    from devinject.api import LiveNode


def watch_options(command: Callable[..., None]) -> Callable[..., None]:
    """The health loop's options, shared by `watch` and `device-plugin` (which runs the same loop)."""
    for option in reversed((
        options.root_option,
        click.option("--output-dir", default=DYNAMIC_SPEC_DIR, show_default=True, type=click.Path(file_okay=False),
                     metavar="DIRECTORY", help=f"Dynamic spec dir (wins over {STATIC_SPEC_DIR})."),
        options.state_dir_option,
        click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
                     help="The spec files' format."),
        click.option("--interval", default=10.0, show_default=True, type=float,
                     help="Seconds between health checks (5-60)."),
        click.option("--recheck", default=1.5, show_default=True, type=float,
                     help="Seconds between re-checks of a failing device (1-2)."),
        click.option("--threshold", default=3, show_default=True, type=click.IntRange(1, 20),
                     help="Consecutive failures (or passes) before a device is taken out (or put back)."),
        click.option("--rescan", default=60.0, show_default=True, type=click.FloatRange(0.05, 3600),
                     help="Seconds between full rediscoveries (uevents trigger one at once)."),
        click.option("--test-timings", is_flag=True, hidden=True, help="Lift the interval ranges (tests, benchmarks)."),
        options.kernel_log_option,
        click.option("--hook-path", default=None, metavar="PATH",
                     help="Absolute path of devinject for the spec's CDI hooks."),
        click.option("--kind", "kinds", multiple=True, metavar="KIND", help="Only this kind (repeatable)."),
        click.option("--uevents/--no-uevents", default=True, show_default=True, help="Listen for kernel uevents."),
        click.option("--nfd-features-dir", default=None, metavar="DIRECTORY",
                     help="Write the node's labels for Node Feature Discovery there (its features.d, e.g. "
                          f"{NFD_FEATURES_DIR}), as the devices change."),
        options.bundles_option,
        options.target_root_option,
        options.driver_root_option,
        options.nvml_option,
        options.node_hook_option,
        options.profile_dir_option,
    )):
        command = option(command)
    return command


def _check_timings(interval: float, recheck: float, rescan: float, test_timings: bool) -> None:
    """The health loop's timings within the ranges it is made for (unless `--test-timings`)."""
    if not test_timings:
        if not 5 <= interval <= 60:
            raise UsageError(f"--interval {interval:g}: must be between 5 and 60 seconds")
        if not 1 <= recheck <= 2:
            raise UsageError(f"--recheck {recheck:g}: must be between 1 and 2 seconds")
    if min(interval, recheck, rescan) <= 0:
        raise UsageError("--interval, --recheck and --rescan must be positive")


def _watch_options(root: str, output_dir: str, state_dir: str, fmt: str, interval: float, recheck: float,
                   threshold: int, rescan: float, test_timings: bool, kernel_log: str, hook_path: str | None,
                   kinds: tuple[str, ...], uevents: bool, bundles: tuple[str, ...],
                   target_root: str | None, driver_root: str | None, node_hook: str | None = None,
                   profile_dirs: tuple[str, ...] = (), nfd_features_dir: str | None = None,
                   nvml: bool | None = None) -> tuple[WatchOptions, LiveNode]:
    """The loop's options, and the node it watches (its roots checked once, here)."""
    from devinject.agent.watch import WatchOptions
    from devinject.linux.trusteddir import trusted_dir
    from devinject.specs.generate import GenerateOptions, default_hook_path

    node = _node(root=root, target_root=target_root, profile_dirs=profile_dirs, state_dir=state_dir,
                 kernel_log=kernel_log, nvml=nvml, driver_root=driver_root)
    trusted_dir(state_dir)  # health verdicts and events the hook trusts: refused when others could write there
    _check_timings(interval, recheck, rescan, test_timings)
    hook_path = _node_hook(root, node_hook, hook_path, target_root)
    gen = GenerateOptions(root=root, kinds=kinds, hook_path=hook_path or default_hook_path(), bundles=bundles,
                          node_hook=_bundle_command(node_hook, hook_path), target_root=target_root,
                          driver_root=driver_root, profile_dirs=profile_dirs, nvml=nvml)
    gen.check()
    return WatchOptions(generate=gen, output_dir=Path(output_dir), state_dir=state_dir, fmt=fmt, interval=interval,
                        recheck=recheck, threshold=threshold, rescan=rescan, kernel_log=kernel_log,
                        uevents=uevents, nfd_features_dir=nfd_features_dir), node


class _Stop(threading.Event):
    """An agent's stop: set by SIGTERM (its service manager: a clean stop, exit 0) or SIGINT (Ctrl-C: exit 130,
    as a shell expects), and said in the agent's log, so that a stop is never silent."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: int | None = None

    def on_signal(self, signum: int, _frame: object) -> None:
        import signal

        if self.signal is None:
            logging.getLogger("devinject").info("%s: stopping", signal.Signals(signum).name)
        self.signal = signum
        self.set()

    def exit(self) -> None:
        """Once the agent has stopped: Ctrl-C's status, or return for a clean stop."""
        import signal

        if self.signal == signal.SIGINT:
            logging.getLogger("devinject").warning("stopped (SIGINT)")
            sys.exit(130)
        if self.signal is not None:
            logging.getLogger("devinject").info("stopped (%s)", signal.Signals(self.signal).name)


def _stop_on_signals() -> _Stop:
    import signal

    stop = _Stop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop.on_signal)
    return stop
