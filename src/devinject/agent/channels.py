"""Health of the devices that are char nodes, not PCI functions (IMEX channels, discovery/channels.py): a
channel is healthy while its node is there with its numbers. `health`, `list`, `watch` and the device plugin
judge them here."""

from __future__ import annotations

from devinject.agent.health import HEALTHY, UNHEALTHY, Verdict
from devinject.cdi.identity import node_id_of
from devinject.discovery.channels import ChannelDevice, channel_fault
from devinject.discovery.host import Host


def channel_verdicts(host: Host, channels: list[ChannelDevice]) -> list[Verdict]:
    """One verdict per channel, keyed `kind=N` (its CDI name, what the spec's exclusions name); a node that is
    gone is a fact, not a reading: unhealthy at once (`definite`)."""
    verdicts = []
    for channel in channels:
        fault = channel_fault(host, channel)
        verdicts.append(Verdict(channel.key, channel.profile.kind, channel.name,
                                HEALTHY if fault is None else UNHEALTHY, () if fault is None else (fault,),
                                (node_id_of(channel.node),), definite=fault is not None))
    return verdicts
