"""Device families that are char nodes, not PCI functions (profiles with `channels`: NVIDIA's IMEX channels).

Every node `<directory>/<prefix>N` on the host is device `N` of the profile's kind (nvidia-ctk's `--mode=imex`
names them so: `nvidia.com/imex-channel=0`), major from the /proc/devices region, minor N; none while the
region is absent (the driver's module is not loaded). `generate`, `list`, `health`, `who` and the device plugin
all take them from here, through the node (discovery/node.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from devinject.cdi.identity import DeviceKey, device_key
from devinject.cdi.model import DeviceNode
from devinject.discovery.discover import HostView
from devinject.discovery.host import Host
from devinject.discovery.profiles import Profile


@dataclass(frozen=True, slots=True)
class ChannelDevice:
    """Channel `number` of `profile`'s family, its one node."""

    profile: Profile
    number: int
    node: DeviceNode

    @property
    def name(self) -> str:
        """Its CDI name without the kind, and the `address` half of its key: `N`."""
        return str(self.number)

    @property
    def key(self) -> DeviceKey:
        """`nvidia.com/imex-channel=N`: what health, watch and the spec's exclusions track it by."""
        return device_key(self.profile.kind, self.name)


def _number(name: str, prefix: str) -> int | None:
    """N of `<prefix>N` as the driver names its nodes (ASCII digits, no leading zero); None for any other
    file there: `channel01` would be channel 1 twice, `channel²` no number at all."""
    digits = name[len(prefix):] if name.startswith(prefix) else ""
    return int(digits) if digits.isascii() and digits.isdigit() and digits == str(int(digits)) else None


def profile_channels(view: HostView, profile: Profile) -> list[ChannelDevice]:
    """The channels of one profile with `channels`, by number."""
    rule = profile.channels
    if rule is None or rule.region not in view.majors:
        return []
    major = view.majors[rule.region]
    numbers = sorted(n for n in (_number(name, rule.prefix) for name in view.host.listdir(rule.directory))
                     if n is not None)
    return [ChannelDevice(profile, n, view.node(f"{rule.directory}/{rule.prefix}{n}", major, n)) for n in numbers]


def discover_channels(view: HostView, profiles: list[Profile]) -> list[ChannelDevice]:
    """Every channel of every profile with `channels`, in profile order, then by number."""
    return [channel for profile in profiles for channel in profile_channels(view, profile)]


def channel_fault(host: Host, channel: ChannelDevice) -> str | None:
    """Why the channel cannot be handed out now, None when it can: its node is gone, or is a char device
    with other numbers than the channel's (a fixture tree's empty file stands in for the node)."""
    path = channel.node.path
    st = host.lstat(path)
    if st is None:
        return f"{path}: no such node"
    device = host.char_device(path)
    if device is not None and (os.major(device.st_rdev), os.minor(device.st_rdev)) != (channel.node.major,
                                                                                         channel.node.minor):
        return (f"{path}: is c {os.major(device.st_rdev)}:{os.minor(device.st_rdev)}, not "
                f"c {channel.node.major}:{channel.node.minor}")
    return None
