"""The one reader of the device names users type. Every command that takes a DEVICE (`doctor`, `events`,
`who`, `put-back`) asks it, so each accepts the same names and refuses an unknown one with the same line.

A device answers to its key (`kind=PCI address`), the PCI address of any of its functions, each of its CDI
names (`nvidia.com/gpu=0`, `nvidia.com/gpu=GPU-<uuid>`, a MIG or partition name), those names without the kind
(`0`, a UUID: every kind's device of that name), and the label `topo` prints for it (`GPU0`, `NIC3`). A channel
answers to its key (`nvidia.com/imex-channel=0`) or its number."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from devinject.cdi.identity import device_key
from devinject.core.errors import DevinjectError

if TYPE_CHECKING:
    from devinject.discovery.channels import ChannelDevice
    from devinject.discovery.discover import FoundDevice
    from devinject.discovery.node import Node

_LABEL = re.compile(r"[A-Z]+\d+")  # what topo prints: GPU0, NIC3, NPU1


class UnknownDevice(DevinjectError):
    """A name no device or channel of the node answers to."""


@dataclass(frozen=True, slots=True)
class Named:
    """What one name stands for on the node."""

    devices: tuple[FoundDevice, ...]
    channels: tuple[ChannelDevice, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys the state dir files them under (events, health, the ledger)."""
        return (*(device_key(d.profile.kind, d.address) for d in self.devices), *(c.key for c in self.channels))

    def __len__(self) -> int:
        return len(self.devices) + len(self.channels)


def topo_labelled(node: Node, label: str) -> tuple[FoundDevice, ...]:
    """The device `topo` labels `label` (GPU0 is the first GPU in the PCIe tree's order, which need not be
    nvidia.com/gpu=0); none for another string."""
    if not _LABEL.fullmatch(label):
        return ()
    topology = node.topology()
    return tuple(d for lab, d in zip(topology.labels, topology.devices, strict=True) if lab == label)


def resolve(node: Node, name: str) -> Named:
    """The devices and channels `name` stands for; UnknownDevice (one line, the nearest names) for none."""
    devices = tuple(node.find(name)) or topo_labelled(node, name)
    named = Named(devices, tuple(node.find_channels(name)))
    if not named:
        raise UnknownDevice(f"{name}: no such device under {node.root}{candidates(node, name)}")
    return named


def resolve_one(node: Node, name: str) -> Named:
    """`resolve`, for a command that acts on exactly one device (put-back): a name that stands for several is
    one line asking for the key."""
    named = resolve(node, name)
    if len(named) != 1:
        raise DevinjectError(f"{name}: names {len(named)} devices ({', '.join(named.keys)}); give one's key "
                             "(kind=PCI address, a channel's kind=N)")
    return named


def candidates(node: Node, name: str) -> str:
    """`; did you mean ...` (the closest names), or `; devices: ...` (all of them, the first ten)."""
    found = node.devices()
    names = [str(node.names(d)[0]) for d in found]
    names += [device_key(d.profile.kind, d.address) for d in found]
    names += [channel.key for channel in node.channels()]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if close:
        return f"; did you mean {' or '.join(close)}?"
    shown = sorted(set(names), key=names.index)
    if not shown:
        return "; it has no devices"
    return f"; devices: {', '.join(shown[:10])}{', ...' if len(shown) > 10 else ''}"
