"""`devinject list`: the devices, their health, sharing, holders and pairs, as a table or JSON."""

from __future__ import annotations

import json
from typing import Any

import click

from devinject.commands.common import _device_order, _missing_kinds, _node
from devinject.commands.group import cli, note
from devinject.commands.options import (
    driver_root_option,
    inventory_options,
    nvml_option,
)
from devinject.core.errors import DevinjectError


def _sharing_cell(record: Any) -> str:
    """How a device is shared now: `time-slicing 2/4` (containers holding it / its replicas), `mps`, or its
    profile's `exclusive` / `shared`."""
    if record.sharing == "time-slicing" and record.replicas:
        pods_only = ("dra-claim:", "device-plugin:")  # bookings for pods, not containers
        held = len([h for h in record.holders if not str(h.container or "").startswith(pods_only)])
        return f"time-slicing {held}/{record.replicas}"
    return str(record.sharing)


@cli.command("list")
@inventory_options
@nvml_option
@driver_root_option
def list_devices(root: str, as_json: bool, kinds: tuple[str, ...], profile_dirs: tuple[str, ...], state_dir: str,
                 kernel_log: str, nvml: bool | None, driver_root: str | None) -> None:
    """Show every discovered device, its health and which container holds it."""
    node = _node(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log, nvml=nvml,
                 driver_root=driver_root)
    rows = sorted((r for r in node.inventory() if not kinds or r.kind in kinds), key=_device_order)
    missing = _missing_kinds(kinds, {r.kind for r in rows})
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2))
    if missing:
        raise DevinjectError(node.why_no_devices(missing))
    if as_json:
        return
    if not rows:
        note(node.why_no_devices())
        return
    header = ("DEVICE", "PCI", "MODEL", "MEMORY", "CC", "NUMA", "DRIVER", "HEALTH", "SHARING", "HELD BY",
              "PAIRED WITH", "NODES")
    table = [header] + [
        (r.name, r.pci_address or "-", r.model, _memory_cell(r.memory_bytes), r.compute_capability or "-",
         "-" if r.numa_node is None else str(r.numa_node), r.driver or "-",
         r.health, _sharing_cell(r), ",".join(h.container or "?" for h in r.holders) or "-",
         ",".join(name for name, _ in r.paired_with) or "-", " ".join(path for path, _, _ in r.nodes))
        for r in rows
    ]
    found = {(f.profile.kind, f.address): f for f in node.devices()}
    at = 1
    for r in rows:  # a GPU split into MIG instances (an AMD GPU into partitions) is offered as those
        device = found.get((r.kind, r.pci_address or ""))
        gpu = node.gpu_facts(device) if device is not None else None
        at += 1
        for part in device.partitions if device is not None else ():
            mig = gpu.mig(part.gpu_instance, part.compute_instance) if gpu and part.kind == "mig" else None
            model = " ".join(filter(None, (part.kind.upper(), mig.profile if mig else None, part.key)))
            table.insert(at, (f"  {r.kind}={part.name}", "-", model, _memory_cell(mig.memory_bytes if mig else None),
                              "-", "-", "-", "-", "-", "-", "-", " ".join(n.path for n in part.nodes)))
            at += 1
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])


def _memory_cell(size: int | None) -> str:
    """A device's memory as nvidia-smi states it (`81559MiB`); `-` when not known."""
    return "-" if not size else f"{size // (1024 * 1024)}MiB"
