"""Discovery: match PCI functions to profiles and work out each device's char nodes.

Everything is read through a `Host`, preferring text sources (sysfs `dev`, `/proc/devices`, procfs
`information` files) over stat(), so fixture trees with empty files stand in for real nodes.
"""

from __future__ import annotations

import logging
import os
import posixpath
import stat
from collections.abc import Iterable
from dataclasses import dataclass, replace

from devinject.cdi.model import DeviceNode
from devinject.discovery.host import Host
from devinject.discovery.partitions import Partition, kfd_partitions, mig_partitions
from devinject.discovery.procfs import parse_key_values, parse_proc_devices
from devinject.discovery.profiles import NodeRule, Profile, glob_names, select_profile
from devinject.discovery.sysfs import PciDevice, read_char_device, scan_pci

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FoundDevice:
    """One device of a profile: one PCI function, or several (one card) with `group-by: slot`."""

    profile: Profile
    index: int
    functions: tuple[PciDevice, ...]
    nodes: tuple[DeviceNode, ...]
    uuid: str | None = None
    partitions: tuple[Partition, ...] = ()  # offered instead of the whole device when there are any

    @property
    def address(self) -> str:
        return self.functions[0].address

    @property
    def pci(self) -> PciDevice:
        return self.functions[0]

    @property
    def model(self) -> str | None:
        return self.profile.model(self.pci)


class HostView:
    """Per-run memo of the host files many devices share (`/proc/devices`, the ld.so.cache)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._majors: dict[str, int] | None = None

    @property
    def majors(self) -> dict[str, int]:
        if self._majors is None:
            self._majors = parse_proc_devices(self.host.read_text("/proc/devices") or "")
        return self._majors

    def node(self, path: str, major: int, minor: int) -> DeviceNode:
        """A char node; file mode from the host node when one exists with these numbers."""
        st = self.host.char_device(path)
        mode = gid = None
        if st is not None and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor):
            mode = stat.S_IMODE(st.st_mode)
            gid = st.st_gid or None  # the host's group (render, video): the node keeps it in the container
        return DeviceNode(path=path, type="c", major=major, minor=minor, file_mode=mode, gid=gid)

    def fixed_node(self, rule: NodeRule, **fields: object) -> DeviceNode | None:
        if rule.region is not None and rule.region not in self.majors:
            return None
        major = rule.major if rule.major is not None else self.majors[str(rule.region)]
        assert rule.path is not None and rule.minor is not None
        return self.node(rule.path.format(**fields), major, rule.minor)

    def sysfs_nodes(self, pattern: str) -> list[DeviceNode]:
        out = []
        for sys_path in self.host.glob(pattern):
            char_device = read_char_device(self.host, sys_path, posixpath.basename(posixpath.dirname(sys_path)))
            if char_device is not None:
                out.append(self.node(char_device.dev_path, char_device.major, char_device.minor))
        return out


def _rule_nodes(view: HostView, rule: NodeRule, functions: Iterable[PciDevice], index: int) -> list[DeviceNode]:
    nodes: list[DeviceNode] = []
    for pci in functions:
        if rule.class_name is not None:
            nodes.extend(
                view.node(cd.dev_path, cd.major, cd.minor)
                for cd in pci.char_devices
                if cd.subsystem == rule.class_name and glob_names(rule.names, cd.name)
            )
        elif rule.proc_file is not None:
            path = rule.proc_file.format(address=pci.address)
            minor = parse_key_values(view.host.read_text(path) or "").get(str(rule.proc_key), "")
            major = rule.major if rule.major is not None else view.majors.get(str(rule.region))
            if minor.isdigit() and major is not None:
                nodes.append(view.node(str(rule.path).format(minor=minor), major, int(minor)))
            elif not rule.optional:
                log.warning("%s: no %r for %s (%s)", rule.proc_file, rule.proc_key, pci.address, view.host.real(path))
        elif rule.iommu_group:
            if pci.iommu_group is not None:
                nodes.extend(view.sysfs_nodes(f"/sys/class/vfio/{pci.iommu_group}"))
        elif rule.sysfs is not None:
            nodes.extend(view.sysfs_nodes(rule.sysfs.format(index=index, address=pci.address)))
            break  # an indexed class device belongs to the card, not to each function
        elif rule.path is not None:
            node = view.fixed_node(rule, index=index, address=pci.address)
            if node is not None:
                nodes.append(node)
    return nodes


def family_of(profiles: list[Profile], pci: PciDevice) -> Profile | None:
    """The vendor profile a function belongs to by identity, when its driver binding does not match."""
    for profile in profiles:
        if profile.drivers and profile.vendors and replace(profile, drivers=()).matches(pci):
            return profile
    return None


def _uuid(view: HostView, profile: Profile, pci: PciDevice) -> str | None:
    if not (profile.uuid_file and profile.uuid_key):
        return None
    text = view.host.read_text(profile.uuid_file.format(address=pci.address)) or ""
    value = parse_key_values(text).get(profile.uuid_key)
    return value if value and value.lower() not in ("n/a", "unknown") else None


def _group(profile: Profile, functions: list[PciDevice]) -> list[tuple[PciDevice, ...]]:
    if profile.group_by == "function":
        return [(pci,) for pci in functions]
    by_slot: dict[str, list[PciDevice]] = {}
    for pci in functions:
        by_slot.setdefault(pci.slot, []).append(pci)
    return [tuple(group) for group in by_slot.values()]


def discover(host: Host, profiles: list[Profile], *, pci_devices: list[PciDevice] | None = None,
             view: HostView | None = None) -> list[FoundDevice]:
    """Every device of every profile, in profile order, then PCI bus order within a profile."""
    view = view or HostView(host)
    functions = scan_pci(host) if pci_devices is None else pci_devices
    per_profile: dict[str, list[PciDevice]] = {p.name: [] for p in profiles}
    placeholders: set[str] = set()
    for pci in functions:
        profile = select_profile(profiles, pci) or family_of(profiles, pci)
        if profile is not None:
            per_profile[profile.name].append(pci)
            if not profile.matches(pci):
                placeholders.add(pci.address)
    found = []
    for profile in profiles:
        for index, all_functions in enumerate(_group(profile, per_profile[profile.name])):
            # A function of the family that is unbound keeps its index, so the others are not renamed.
            group = tuple(f for f in all_functions if f.address not in placeholders)
            if not group:
                continue
            nodes: list[DeviceNode] = []
            complete = True
            for rule in profile.device_nodes:
                rule_nodes = _rule_nodes(view, rule, group, index)
                if not rule_nodes and not rule.optional:
                    complete = False
                nodes.extend(rule_nodes)
            if not complete or not nodes:
                log.warning("%s %s: device nodes not found; not offered", profile.kind, group[0].address)
                continue
            uuid = _uuid(view, profile, group[0])
            partitions = _partitions(view, profile, nodes[0], index, group[0].address)
            found.append(FoundDevice(profile, index, group, tuple(dict.fromkeys(nodes)), uuid, partitions))
    return found


def _partitions(view: HostView, profile: Profile, parent: DeviceNode, index: int,
                address: str) -> tuple[Partition, ...]:
    rule = profile.partitions
    if rule is None or parent.minor is None:
        return ()
    source = rule.source.format(device_minor=parent.minor)
    if not view.host.is_dir(source):
        return ()
    if rule.region not in view.majors:
        log.warning("%s %s: %s has partitions but /proc/devices has no %s; offered whole", profile.kind,
                    parent.path, source, rule.region)
        return ()
    major = view.majors[rule.region]
    if rule.type == "nvidia-mig":
        return tuple(mig_partitions(view.host, source, rule.node, major, parent, index, rule.shared))
    return tuple(kfd_partitions(view.host, source, address, rule.node, major, view.node, index))


def shared_nodes(view: HostView, profile: Profile) -> list[DeviceNode]:
    nodes: list[DeviceNode] = []
    for rule in profile.shared_nodes:
        if rule.sysfs is not None:
            rule_nodes = view.sysfs_nodes(rule.sysfs)
        else:
            node = view.fixed_node(rule)
            rule_nodes = [node] if node is not None else []
        if not rule_nodes and not rule.optional:
            log.warning("%s: shared node %s not found", profile.kind, rule.path or rule.sysfs)
        nodes.extend(rule_nodes)
    return nodes
