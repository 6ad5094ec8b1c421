"""What `devinject list` shows: one row per discovered device, as plain data."""

from __future__ import annotations

from typing import Any

from devinject.discover import discover
from devinject.generate import device_names
from devinject.host import Host
from devinject.profiles import load_profiles

VENDOR_NAMES = {0x10DE: "NVIDIA", 0x1002: "AMD", 0x8086: "Intel", 0x1DA3: "Habana", 0x15B3: "Mellanox",
                0x19E5: "Huawei", 0x10EE: "Xilinx"}


def inventory(root: str, *, profile_dirs: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    host = Host(root)
    rows = []
    for found in discover(host, load_profiles(host, profile_dirs)):
        pci = found.pci
        vendor = VENDOR_NAMES.get(pci.vendor, f"{pci.vendor:04x}")
        rows.append({
            "names": [f"{found.profile.kind}={n}" for n in device_names(found, ())],
            "kind": found.profile.kind,
            "pci": found.address,
            "functions": [f.address for f in found.functions],
            "vendor": vendor,
            "model": found.model or f"{vendor} {pci.device:04x}",
            "pci_id": f"{pci.vendor:04x}:{pci.device:04x}",
            "uuid": found.uuid,
            "numa_node": pci.numa_node,
            "driver": pci.driver,
            "sharing": found.profile.sharing,
            "nodes": [{"path": n.path, "major": n.major, "minor": n.minor} for n in found.nodes],
        })
    return rows
