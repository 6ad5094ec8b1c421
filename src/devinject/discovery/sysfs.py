"""PCI functions and their char devices, read from sysfs under a `Host`."""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass

from devinject.discovery.host import Host
from devinject.discovery.procfs import parse_dev_numbers, parse_uevent

log = logging.getLogger(__name__)

PCI_DEVICES = "/sys/bus/pci/devices"
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True, slots=True)
class CharDevice:
    """A class device with a device number: `devname` is its path under /dev."""

    subsystem: str
    name: str
    devname: str
    major: int
    minor: int
    sys_path: str

    @property
    def dev_path(self) -> str:
        return "/dev/" + self.devname


@dataclass(frozen=True, slots=True)
class PciDevice:
    address: str
    vendor: int
    device: int
    class_code: int
    subsystem_vendor: int | None
    subsystem_device: int | None
    numa_node: int
    driver: str | None
    sys_path: str
    iommu_group: str | None
    physfn: str | None
    char_devices: tuple[CharDevice, ...]

    @property
    def slot(self) -> str:
        """The address without its function: the two PFs of one card share it."""
        return self.address.rpartition(".")[0]

    @property
    def class_hex(self) -> str:
        return f"{self.class_code:06x}"


def _hex_attr(host: Host, path: str) -> int | None:
    value = host.read_attr(path)
    if value is None:
        return None
    try:
        return int(value, 16)
    except ValueError:
        return None


def read_char_device(host: Host, sys_path: str, subsystem: str) -> CharDevice | None:
    """A class device directory with `dev`; DEVNAME from `uevent`, else the directory name with the kernel's
    `!` -> `/` rule (a class device `tenstorrent!0` is the node `/dev/tenstorrent/0`)."""
    dev = host.read_attr(sys_path + "/dev")
    numbers = parse_dev_numbers(dev) if dev else None
    if numbers is None:
        return None
    uevent = parse_uevent(host.read_text(sys_path + "/uevent") or "")
    name = posixpath.basename(sys_path)
    return CharDevice(subsystem, name, uevent.get("DEVNAME") or name.replace("!", "/"), numbers[0], numbers[1],
                      sys_path)


def child_char_devices(host: Host, sys_path: str) -> tuple[CharDevice, ...]:
    """Class devices whose parent is this PCI function: `<fn>/<class>/<name>/dev`."""
    found = []
    for subsystem in host.listdir(sys_path):
        class_dir = f"{sys_path}/{subsystem}"
        if _BDF.match(subsystem) or host.is_link(class_dir) or not host.is_dir(class_dir):
            continue
        for name in host.listdir(class_dir):
            child = f"{class_dir}/{name}"
            if host.is_link(child) or not host.is_dir(child):
                continue
            char_device = read_char_device(host, child, subsystem)
            if char_device is not None:
                found.append(char_device)
    return tuple(found)


def read_pci_device(host: Host, address: str) -> PciDevice | None:
    """One PCI function, or None (with a warning naming the path) when its identity cannot be read."""
    link = f"{PCI_DEVICES}/{address}"
    sys_path = host.resolve(link)
    vendor = _hex_attr(host, sys_path + "/vendor")
    device = _hex_attr(host, sys_path + "/device")
    class_code = _hex_attr(host, sys_path + "/class")
    if vendor is None or device is None or class_code is None:
        missing = [n for n, v in (("vendor", vendor), ("device", device), ("class", class_code)) if v is None]
        log.warning("skipping PCI device %s: cannot read %s under %s", address, "/".join(missing), sys_path)
        return None
    numa = host.read_attr(sys_path + "/numa_node")
    driver_link = host.readlink(sys_path + "/driver")
    group_link = host.readlink(sys_path + "/iommu_group")
    physfn_link = host.readlink(sys_path + "/physfn")
    return PciDevice(
        address=address,
        vendor=vendor,
        device=device,
        class_code=class_code,
        subsystem_vendor=_hex_attr(host, sys_path + "/subsystem_vendor"),
        subsystem_device=_hex_attr(host, sys_path + "/subsystem_device"),
        numa_node=int(numa) if numa and numa.lstrip("-").isdigit() else -1,
        driver=posixpath.basename(driver_link) if driver_link else None,
        sys_path=sys_path,
        iommu_group=posixpath.basename(group_link) if group_link else None,
        physfn=posixpath.basename(physfn_link) if physfn_link else None,
        char_devices=child_char_devices(host, sys_path),
    )


def scan_pci(host: Host) -> list[PciDevice]:
    """Every readable PCI function, in bus order (what nvidia-smi and friends index by)."""
    devices = []
    for address in host.listdir(PCI_DEVICES):
        if not _BDF.match(address):
            log.warning("skipping %s/%s: not a PCI address", PCI_DEVICES, address)
            continue
        pci = read_pci_device(host, address)
        if pci is not None:
            devices.append(pci)
    return devices
