"""Who consumes a round of `watch`'s loop (agent/watch.py): each publisher is told, after every rescan or
verdict that changed what is published, with the round's result (`Round`: the devices, channels, tracks,
and the specs the publishers before it wrote). The node's files are published here, in this order: the CDI
specs, health.json, NFD's feature file; the processes that run the loop add their own after them (the
device plugin's stream to the kubelet: deviceplugin/agent.py, the DRA driver's ResourceSlices: dra/driver.py). A
new publisher is one class here and one line in `default_publishers`."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from devinject.agent.health import UNHEALTHY
from devinject.agent.healthtracker import DeviceTrack
from devinject.cdi.model import Spec
from devinject.discovery.channels import ChannelDevice
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.discovery.node import Node
from devinject.discovery.profiles import Profile
from devinject.nodestate import healthverdicts
from devinject.nodestate.healthverdicts import DeviceVerdict, HealthVerdicts
from devinject.specs.generate import GenerateOptions, build_specs, write_specs

log = logging.getLogger("devinject.agent.watch")  # what the loop says, under the loop's name


class Round(Protocol):
    """What a round of the loop (agent/watch.py `Watcher`) leaves for its publishers."""

    @property
    def host(self) -> Host: ...
    @property
    def profiles(self) -> list[Profile]: ...  # the kinds served
    @property
    def found(self) -> list[FoundDevice]: ...
    @property
    def channels(self) -> list[ChannelDevice]: ...
    @property
    def tracks(self) -> dict[str, DeviceTrack]: ...  # by device key: each device's published health
    @property
    def specs(self) -> list[Spec]: ...  # as the spec files publisher last wrote them (none without it)
    @property
    def scanned(self) -> Node: ...  # the node as the round's rescan read it (NVML's facts: Node.gpu_facts)

    def unhealthy(self) -> frozenset[str]: ...  # the keys of the devices taken out


class RoundPublisher(Protocol):
    """Told after every round that changed what is published (and after the first): spec files, health file,
    NFD labels (not dra/driver.py's SliceApi, the API server the DRA driver publishes slices to)."""

    def __call__(self, result: Round, /) -> None: ...


class SpecFiles:
    """The served kinds' CDI specs in the output dir, devices taken out left out; a kind with no device left
    loses its spec. `specs` and `generation`: as last written."""

    def __init__(self, generate: GenerateOptions, output_dir: Path, fmt: str) -> None:
        self.generate, self.output_dir, self.fmt = generate, output_dir, fmt
        self.specs: list[Spec] = []
        self.generation: int | None = None
        self.written_kinds: set[str] = set()

    def __call__(self, result: Round, /) -> None:
        from devinject.specs.bundles import possible_bundle_kinds
        from devinject.specs.sequence import current

        gen = replace(self.generate, exclude=result.unhealthy())
        specs = build_specs(result.host, result.profiles, result.found, gen)
        kinds = {s.kind for s in specs}
        offered = {p.kind for p in result.profiles}
        offered |= possible_bundle_kinds(offered, gen.bundles)
        stale = tuple(sorted((self.written_kinds | offered) - kinds))
        write_specs(specs, self.output_dir, self.fmt, managed=True, stale_kinds=stale)
        self.written_kinds = kinds
        self.specs = specs
        self.generation = current(self.output_dir)


def write_health_file(state_dir: str, unhealthy_nodes: list[str], devices: dict[str, DeviceVerdict]) -> None:
    """health.json: what the ledger refuses (`unhealthy_nodes`) and each device's published verdict with its
    latest check, which `list` and `health` show (its record and reader: nodestate/healthverdicts.py)."""
    healthverdicts.write(state_dir, HealthVerdicts(tuple(unhealthy_nodes), devices, time.time()))


class HealthFile:
    """health.json in the state dir. Written with the specs, and after a round whose verdicts changed
    (`refresh`), so that a reader never shows an older check than the agent's."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.written: tuple[list[str], dict[str, DeviceVerdict]] | None = None  # as last written

    def __call__(self, result: Round, /) -> None:
        self.write(result.tracks)

    def refresh(self, tracks: dict[str, DeviceTrack]) -> None:
        """Written again when what it says changed, once it has been written at all."""
        if self.written is not None:
            self.write(tracks, only_if_changed=True)

    def write(self, tracks: dict[str, DeviceTrack], *, only_if_changed: bool = False) -> None:
        unhealthy_nodes = sorted({n for t in tracks.values() if t.published == UNHEALTHY and t.last
                                  for n in t.last.nodes})
        devices = {k: DeviceVerdict(t.published, t.last.status if t.last else None,
                                    tuple(t.last.reasons) if t.last else ()) for k, t in tracks.items()}
        if only_if_changed and (unhealthy_nodes, devices) == self.written:
            return
        self.written = (unhealthy_nodes, devices)
        write_health_file(self.state_dir, unhealthy_nodes, devices)


class NfdFeatures:
    """The node's labels for NFD (agent/nfd.py), devices taken out not counted; a failed write is logged,
    the specs already written stand."""

    def __init__(self, features_dir: str) -> None:
        self.features_dir = features_dir

    def __call__(self, result: Round, /) -> None:
        from devinject.agent.nfd import features, write_features

        try:
            lines = features(result.host, result.found, out=result.unhealthy(), gpu_facts=result.scanned.gpu_facts)
            if write_features(self.features_dir, lines):
                log.info("wrote the node's labels for NFD in %s", self.features_dir)
        except OSError as err:
            log.warning("%s: cannot write NFD's feature file: %s", self.features_dir, err.strerror)


def default_publishers(generate: GenerateOptions, output_dir: Path | None, fmt: str, health: HealthFile,
                       nfd_features_dir: str | None) -> list[RoundPublisher]:
    """The node's files, in order: the specs in `output_dir` (none: the loop writes no spec, the DRA
    driver's), `health`, NFD's feature file when asked for."""
    publishers: list[RoundPublisher] = [SpecFiles(generate, output_dir, fmt)] if output_dir is not None else []
    publishers.append(health)
    if nfd_features_dir:
        publishers.append(NfdFeatures(nfd_features_dir))
    return publishers
