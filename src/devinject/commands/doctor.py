"""`devinject doctor`."""

from __future__ import annotations

import json
import sys

import click

from devinject.commands.common import _check_kubeconfig, _node
from devinject.commands.group import cli, note
from devinject.commands.options import (
    driver_root_option,
    json_option,
    nvml_option,
    profile_dir_option,
    root_option,
    state_dir_option,
)
from devinject.core.errors import UsageError
from devinject.core.paths import (
    DYNAMIC_SPEC_DIR,
    STATIC_SPEC_DIR,
)
from devinject.runtimes.names import RUNTIMES


@cli.command()
@click.argument("device", required=False)
@root_option
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIRECTORY",
              help=f"A CDI spec directory to look in (repeatable) [default: {STATIC_SPEC_DIR}, {DYNAMIC_SPEC_DIR}].")
@click.option("--runtime", "runtime_name", default=None,
              type=click.Choice(RUNTIMES),
              help="The runtime that starts the containers [default: the one whose configuration is on the node].")
@click.option("--runtime-version", default=None, metavar="VERSION",
              help="The runtime's version [default: asked of its binary when --root is /].")
@state_dir_option
@profile_dir_option
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Kubeconfig for the API server: check the node's ResourceSlices (the slice link) [default: "
                   "$KUBECONFIG, else the pod's service account, else none: the link is left out].")
@click.option("--node-name", envvar="NODE_NAME", default=None, metavar="NAME",
              help="This node's name in the API (env NODE_NAME) [default: the host name, in lower case].")
@click.option("--driver-name", default="dra.devinject.io", show_default=True, metavar="NAME",
              help="The DRA driver whose slices are checked.")
@click.option("--dra-metrics", default="127.0.0.1:9401", show_default=True, metavar="HOST:PORT",
              help="The DRA driver's /metrics, read for the publishes it counts as failed ('' not to; the "
                   "shipped DaemonSet serves it on the node's IP).")
@json_option
@nvml_option
@driver_root_option
def doctor(device: str | None, root: str, spec_dirs: tuple[str, ...], runtime_name: str | None,
           runtime_version: str | None, state_dir: str, profile_dirs: tuple[str, ...], kubeconfig: str | None,
           node_name: str | None, driver_name: str, dra_metrics: str, as_json: bool, nvml: bool | None,
           driver_root: str | None) -> None:
    """Walk each device's chain to a container (pci, driver, nodes, libraries, spec, runtime, ledger, health,
    kubelet, and with an API server its ResourceSlice) and name the first broken link and its fix; exit 0
    only when every link holds.

    DEVICE: an index or CDI name (nvidia.com/gpu=0), a UUID, a PCI address or kind=PCI address."""
    from devinject.core.paths import DEFAULT_SPEC_DIRS
    from devinject.doctor import DoctorOptions, diagnose, render, slice_api

    if kubeconfig is not None:
        _check_kubeconfig(kubeconfig)
    import socket

    if dra_metrics and not dra_metrics.rpartition(":")[2].isdigit():
        raise UsageError(f"--dra-metrics {dra_metrics!r}: expected HOST:PORT")
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, nvml=nvml, driver_root=driver_root)
    api = slice_api(kubeconfig)
    found = diagnose(node, device, DoctorOptions(
        spec_dirs=spec_dirs or DEFAULT_SPEC_DIRS, runtime=runtime_name, runtime_version=runtime_version, api=api,
        node_name=node_name or socket.gethostname().lower(), driver=driver_name, metrics_address=dra_metrics or None))
    if as_json:
        click.echo(json.dumps([d.to_json() for d in found], indent=2))
    elif found:
        click.echo(render(found), nl=False)
    if not found:  # nothing to walk is the first link broken
        note(node.why_no_devices(), error=True)
    sys.exit(0 if found and all(d.ok for d in found) else 1)
