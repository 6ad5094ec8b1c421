"""`devinject device-plugin`."""

from __future__ import annotations

from typing import Any

import click

from devinject.commands.agentloop import _stop_on_signals, _watch_options, watch_options
from devinject.commands.common import _check_metrics_address
from devinject.commands.configfile import _load_config
from devinject.commands.group import cli
from devinject.commands.options import pod_uid_option
from devinject.core.errors import UsageError


@cli.command("device-plugin")
@click.option("--config", metavar="FILE", is_eager=True, expose_value=False, callback=_load_config,
              help="YAML file of option values (e.g. the DaemonSet's ConfigMap); flags given win over it.")
@watch_options
@click.option("--plugin-dir", default="/var/lib/kubelet/device-plugins", show_default=True,
              type=click.Path(file_okay=False), metavar="DIRECTORY",
              help="The kubelet's device-plugins directory (kubelet.sock).")
@click.option("--resource-name", "resource_names", multiple=True, metavar="KIND=NAME",
              help="Serve KIND as resource NAME (repeatable; default: the kind, e.g. nvidia.com/gpu).")
@click.option("--allocate", type=click.Choice(["both", "cdi"]), default="both", show_default=True,
              help="cdi: answer with CDI device names only; both: also devices, mounts and env for runtimes "
                   "without CDI.")
@click.option("--metrics-address", default="127.0.0.1:9400", show_default=True, metavar="HOST:PORT",
              help="HOST:PORT for /metrics, /healthz and /readyz (the DaemonSet: the node's address; "
                   "'' to turn them off).")
@click.option("--mig-strategy", type=click.Choice(["single", "mixed"]), default="single", show_default=True,
              help="single: MIG devices offered as their GPU's kind (nvidia.com/gpu); mixed: as one resource per "
                   "MIG profile, nvidia.com/mig-<profile> (profiles from NVML; docs/sharing.md).")
@pod_uid_option
def device_plugin(plugin_dir: str, resource_names: tuple[str, ...], allocate: str, metrics_address: str,
                  mig_strategy: str, pod_uid: str | None, **options: Any) -> None:
    """Kubernetes node agent: a kubelet device plugin per kind, with watch's health loop and specs."""
    from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions

    names: dict[str, str] = {}
    for item in resource_names:
        kind, sep, name = item.partition("=")
        if not sep or not kind or not name or "/" not in name:
            raise UsageError(f"--resource-name {item!r}: expected KIND=vendor.com/name")
        names[kind] = name
    _check_metrics_address(metrics_address)
    watch, node = _watch_options(**options)
    from devinject.deviceplugin.sharing import SharingConfig

    sharing = click.get_current_context().meta.get("devinject.sharing", SharingConfig())
    opts = PluginOptions(watch=watch, plugin_dir=plugin_dir, resource_names=names, fallback=allocate == "both",
                         metrics_address=metrics_address or None, sharing=sharing, mig_strategy=mig_strategy,
                         pod_uid=pod_uid)
    stop = _stop_on_signals()
    DevicePluginAgent(opts, node=node).run(stop)
    stop.exit()
