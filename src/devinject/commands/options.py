"""The options several commands share: each written once, here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from devinject.core.paths import (
    DEFAULT_KERNEL_LOG,
    DEFAULT_STATE_DIR,
)


class RenamedOption(click.Option):
    """An option that had another spelling: the old one (`renamed_from`) is still parsed, also as a --config
    key, and is left out of --help and of click's error hints, so that one meaning has one spelling on every
    command (docs/lifecycle.md, "Option names")."""

    def __init__(self, *args: Any, renamed_from: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renamed_from = renamed_from
        self.opts = [*self.opts, *renamed_from]

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        every = self.opts
        self.opts = [name for name in every if name not in self.renamed_from]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = every

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return " / ".join(f"'{name}'" for name in self.opts if name not in self.renamed_from)


bundles_option = click.option(
    "--bundles", "bundles", multiple=True, type=click.Choice(["gpu-nic"]),
    help="Also offer co-bound devices: gpu-nic = each GPU with its closest RDMA NIC (<vendor>/gpu-nic=<index>) "
         "and each NUMA node's GPUs and NICs (=numa<N>); see `devinject topo`.")


root_option = click.option(
    "--host-root", "--root", "root", default="/", show_default=True, metavar="DIRECTORY",
    help="Read the host under this directory (the host's / mounted in a pod, a driver root, a fixture host).",
)


kind_option = click.option(
    "--kind", "kinds", multiple=True, metavar="KIND",
    help="Only devices of KIND, e.g. nvidia.com/gpu (repeatable; exit 1 when one has none).")


driver_root_option = click.option(
    "--driver-root", default=None, type=click.Path(), metavar="DIRECTORY",
    help="Where the driver's files are, as the host names it (a driver installed in a container, e.g. "
         "/run/nvidia/driver): libraries, binaries and firmware come from there, device nodes from the host.")


nvml_option = click.option(
    "--nvml/--no-nvml", default=None,
    help="Ask NVML (the driver's libnvidia-ml under the root or --driver-root) for its GPUs' facts: UUIDs, "
         "memory, compute capability, MIG profiles (default: only when --root is /).")


def _pod_uid(_ctx: click.Context, _param: click.Parameter, uid: str | None) -> str | None:
    from devinject.core.errors import DevinjectError, UsageError
    from devinject.core.poduid import checked_pod_uid

    try:
        return None if uid is None else checked_pod_uid(uid)
    except DevinjectError as err:
        raise UsageError(err.message) from None


pod_uid_option = click.option(
    "--pod-uid", default=None, metavar="UID", callback=_pod_uid,
    help="The agent's own pod's UID (the DaemonSet: the downward API's metadata.uid): its kubelet sockets carry "
         "it, so a rolling update's two pods overlap on a node (docs/deploy.md).")


target_root_option = click.option(
    "--target-root", default=None, type=click.Path(), metavar="DIRECTORY",
    help="The host's / as the runtime that reads the specs sees it (usually /): host paths are written under it "
         "instead of under --host-root.")


profile_dir_option = click.option(
    "--profile-dir", "profile_dirs", multiple=True, metavar="DIRECTORY",
    help="Extra directory of device profiles (besides <root>/etc/devinject/profiles.d; repeatable).")


node_hook_option = click.option(
    "--node-hook", default=None, metavar="DIRECTORY",
    help="Run the specs' CDI hooks from the node hook bundle installed in DIRECTORY (a host path; see "
         "install-node-hook). No spec is written until that bundle is there, is this devinject's and runs. "
         "Use it instead of --hook-path.")


state_dir_option = click.option("--state-dir", default=DEFAULT_STATE_DIR, show_default=True, metavar="DIRECTORY",
                                help="devinject's node state: ledger, health, events.")


kernel_log_option = click.option(
    "--kernel-log", default="auto", show_default=True, metavar="SOURCE",
    help="Where the kernel's messages (NVIDIA Xids) are read, under --root: auto, kmsg (/dev/kmsg), journal "
         f"(journalctl), a syslog FILE; auto: kmsg if it can be opened, else the journal, else {DEFAULT_KERNEL_LOG}.")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def stacked(*options: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Several options as one decorator, listed by --help in the order given."""

    def apply(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


# what the commands that read the node's devices and their state take, in --help's order
inventory_options = stacked(root_option, json_option, kind_option, profile_dir_option, state_dir_option,
                            kernel_log_option)  # list, health
device_state_options = stacked(click.argument("device", required=False), root_option, state_dir_option,
                               profile_dir_option, kind_option, json_option)  # events, who
