"""`devinject dra-driver`."""

from __future__ import annotations

import click

from devinject.commands.agentloop import _check_timings, _stop_on_signals
from devinject.commands.common import (
    _bundle_command,
    _check_kubeconfig,
    _check_metrics_address,
    _check_roots,
    _node_hook,
)
from devinject.commands.configfile import _load_config
from devinject.commands.group import cli
from devinject.commands.options import (
    RenamedOption,
    driver_root_option,
    kernel_log_option,
    node_hook_option,
    nvml_option,
    pod_uid_option,
    profile_dir_option,
    root_option,
    state_dir_option,
    target_root_option,
)
from devinject.core.errors import UsageError
from devinject.core.paths import (
    DYNAMIC_SPEC_DIR,
    NFD_FEATURES_DIR,
)


@cli.command("dra-driver")
@click.option("--config", metavar="FILE", is_eager=True, expose_value=False, callback=_load_config,
              help="YAML file of option values (e.g. the DaemonSet's ConfigMap); flags given win over it.")
@root_option
@state_dir_option
@profile_dir_option
@target_root_option
@driver_root_option
@nvml_option
@node_hook_option
@click.option("--hook-path", default=None, metavar="PATH",
              help="Absolute path of devinject for the claim specs' CDI hooks.")
@click.option("--kind", "kinds", multiple=True, metavar="KIND", help="Only this kind (repeatable).")
@click.option("--node-name", envvar="NODE_NAME", required=True, metavar="NAME",
              help="This node's name (env NODE_NAME).")
@click.option("--driver-name", default="dra.devinject.io", show_default=True, metavar="NAME",
              help="The DRA driver name.")
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Kubeconfig for the API server (default: the pod's service account).")
@click.option("--plugin-dir", default="/var/lib/kubelet/plugins", show_default=True, type=click.Path(file_okay=False),
              metavar="DIRECTORY",
              help="The kubelet's plugins directory (the DRA socket goes in <driver-name>/dra.sock).")
@click.option("--registry-dir", default="/var/lib/kubelet/plugins_registry", show_default=True,
              type=click.Path(file_okay=False), metavar="DIRECTORY",
              help="The kubelet's plugin registration directory.")
@click.option("--output-dir", "cdi_dir", cls=RenamedOption, renamed_from=("--cdi-dir",), default=DYNAMIC_SPEC_DIR,
              show_default=True, type=click.Path(file_okay=False), metavar="DIRECTORY",
              help="Where the claim-scoped CDI specs go.")
@click.option("--rescan", default=30.0, show_default=True, type=click.FloatRange(0.05, 3600),
              help="Seconds between rediscoveries (and slice updates; a health verdict is published at once).")
@click.option("--health", "health_mode", type=click.Choice(["auto", "check", "follow"]), default="auto",
              show_default=True,
              help="auto: run the node's health loop here unless another agent's (watch, device-plugin) runs on "
                   "the state dir, then follow its verdicts; check: always here; follow: never here.")
@click.option("--interval", default=10.0, show_default=True, type=float, help="Seconds between health checks (5-60).")
@click.option("--recheck", default=1.5, show_default=True, type=float,
              help="Seconds between re-checks of a failing device (1-2).")
@click.option("--threshold", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Consecutive failures (or passes) before a device is taken out (or put back).")
@click.option("--test-timings", is_flag=True, hidden=True, help="Lift the interval ranges (tests, benchmarks).")
@kernel_log_option
@click.option("--uevents/--no-uevents", default=True, show_default=True, help="Listen for kernel uevents.")
@click.option("--fatal-taint-effect", type=click.Choice(["NoSchedule", "NoExecute"]), default="NoSchedule",
              show_default=True,
              help="The taint effect of a fatal fault (Xid, AER fatal, gone): NoExecute also evicts the pods using "
                   "the device (the taint-eviction controller); other faults are always NoSchedule.")
@click.option("--metrics-address", default="127.0.0.1:9401", show_default=True, metavar="HOST:PORT",
              help="HOST:PORT for /metrics, /healthz and /readyz (the DaemonSet: the pod's address; '' to turn "
                   "them off).")
@click.option("--consumable-capacity", default="off", show_default=True, metavar="shares=N[,memory=Q|auto]",
              help="Publish each whole GPU with allowMultipleAllocations and shareable capacity "
                   "(DRAConsumableCapacity): at most N claims per GPU, and its memory (e.g. 80Gi; auto: what "
                   "NVML or sysfs states) for claims' capacity.requests (docs/sharing.md).")
@click.option("--nfd-features-dir", default=None, metavar="DIRECTORY",
              help="Write the node's labels for Node Feature Discovery there (its features.d, e.g. "
                   f"{NFD_FEATURES_DIR}), as the devices change.")
@click.option("--device-metadata/--no-device-metadata", default=False, show_default=True,
              help="Give each claim's containers its devices and their attributes (KEP-5304): a metadata.json "
                   "per request under --plugin-dir, mounted read-only at /var/run/kubernetes.io/"
                   "dra-device-attributes/... (docs/dra.md).")
@pod_uid_option
def dra_driver(root: str, state_dir: str, profile_dirs: tuple[str, ...], target_root: str | None,
               driver_root: str | None, nvml: bool | None, node_hook: str | None, hook_path: str | None,
               kinds: tuple[str, ...], node_name: str, driver_name: str, kubeconfig: str | None, plugin_dir: str,
               registry_dir: str, cdi_dir: str, rescan: float, health_mode: str, interval: float, recheck: float,
               threshold: int, test_timings: bool, kernel_log: str, uevents: bool, fatal_taint_effect: str,
               metrics_address: str, consumable_capacity: str, nfd_features_dir: str | None,
               device_metadata: bool, pod_uid: str | None) -> None:
    """Kubernetes DRA kubelet plugin: ResourceSlices from discovery with the node's health loop (faults as
    device taints), claims prepared as CDI specs (docs/dra.md)."""
    from devinject.agent.watch import WatchOptions
    from devinject.cdi.names import vendor_problem
    from devinject.dra.driver import DraDriver, DraOptions
    from devinject.dra.publisher import SlicePublisher, api_client
    from devinject.linux.trusteddir import make_dirs, trusted_dir
    from devinject.specs.generate import GenerateOptions, default_hook_path

    if kubeconfig is not None:
        _check_kubeconfig(kubeconfig)
    problem = vendor_problem(driver_name)
    if problem or driver_name != driver_name.lower():
        raise UsageError(f"--driver-name {driver_name!r}: {problem or 'must be lower case'} (a DNS subdomain)")
    _check_metrics_address(metrics_address)
    from devinject.dra.capacity import CapacityError, parse_capacity_sharing

    try:
        capacity = parse_capacity_sharing(consumable_capacity)
    except CapacityError as err:
        raise UsageError(err.message) from None
    _check_roots(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log)
    _check_timings(interval, recheck, rescan, test_timings)
    trusted_dir(state_dir)
    make_dirs(cdi_dir)
    hook_path = _node_hook(root, node_hook, hook_path, target_root)
    gen = GenerateOptions(root=root, kinds=kinds, hook_path=hook_path or default_hook_path(), profile_dirs=profile_dirs,
                          node_hook=_bundle_command(node_hook, hook_path), target_root=target_root,
                          driver_root=driver_root, nvml=nvml)
    gen.check()
    watch = WatchOptions(generate=gen, state_dir=state_dir, interval=interval, recheck=recheck, threshold=threshold,
                         rescan=rescan, kernel_log=kernel_log, uevents=uevents, specs=False)
    opts = DraOptions(generate=gen, node_name=node_name, driver=driver_name, plugin_dir=plugin_dir,
                      registry_dir=registry_dir, cdi_dir=cdi_dir, state_dir=state_dir, rescan=rescan,
                      health=health_mode, watch=watch, fatal_effect=fatal_taint_effect,
                      metrics_address=metrics_address or None, capacity=capacity,
                      nfd_features_dir=nfd_features_dir, device_metadata=device_metadata,
                      pod_uid=pod_uid)
    stop = _stop_on_signals()
    DraDriver(opts, SlicePublisher(api_client(kubeconfig), driver_name, node_name, watch=True)).run(stop)
    stop.exit()
