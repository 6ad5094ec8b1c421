"""The device plugin's MIG strategies, as NVIDIA's device plugin names them (docs/sharing.md, "MIG strategies"):

- `single` (the default): every MIG device is offered under its GPU's kind (`nvidia.com/gpu`) beside the
  node's whole GPUs, as devinject always did. NVIDIA's plugin refuses a node whose MIG devices are not all of
  one profile or whose GPUs are not all in one MIG mode; devinject serves it and says so in one warning.
- `mixed`: whole GPUs stay `nvidia.com/gpu`; each MIG device is offered as the resource of its profile,
  `nvidia.com/mig-<profile>` (`nvidia.com/mig-1g.10gb`). Profiles come from NVML alone (discovery/nvml.py):
  procfs gives a MIG device's GPU and compute instance ids and capability nodes, never its size, so a MIG
  device NVML does not describe is not offered (one warning), never offered under a wrong profile. Nor is one
  whose profile no resource name can take (`1g.10gb+me`, a media-extension profile: the kubelet refuses
  `nvidia.com/mig-1g.10gb+me`'s registration, and with it the profile's every device).

NVIDIA's `none` (a MIG-enabled GPU offered whole, which CUDA cannot use) is not offered: devinject never hands
out a GPU whose MIG devices others may hold.

A served resource is keyed in the agent by its kind, or `<kind>#<profile>` for a profile's resource."""

from __future__ import annotations

import re
from collections.abc import Sequence

from devinject.discovery.nvml import GpuFacts, mig_resource
from devinject.discovery.partitions import Partition

SINGLE, MIXED = "single", "mixed"
MIG_STRATEGIES = (SINGLE, MIXED)
__all__ = ["MIG_STRATEGIES", "MIXED", "SINGLE", "kind_of", "mig_resource", "offer_keys", "partition_profiles",
           "profile_key", "profile_of", "single_mismatch", "unnameable_profiles"]
_PROFILE = "#"
# the name part of a kubelet extended resource name (a qualified name's, ASCII): at most 63 characters
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", re.ASCII)


def nameable(profile: str) -> bool:
    """Whether a profile's resource (`<domain>/mig-<profile>`) is a name the kubelet registers."""
    return _RESOURCE_NAME.fullmatch(f"mig-{profile}") is not None


def profile_key(kind: str, profile: str) -> str:
    """The agent's key of a profile's resource."""
    return f"{kind}{_PROFILE}{profile}"


def kind_of(key: str) -> str:
    """The kind a served key's devices are of (their spec, their health)."""
    return key.partition(_PROFILE)[0]


def profile_of(key: str) -> str | None:
    """The MIG profile a served key offers, None for a kind's own resource."""
    _, sep, profile = key.partition(_PROFILE)
    return profile if sep else None


def partition_profiles(partitions: Sequence[Partition], gpu: GpuFacts | None) -> list[str | None]:
    """Each partition's MIG profile as NVML names it (`3g.40gb`), None where NVML does not say (no facts, an
    AMD partition, a MIG device NVML did not list)."""
    profiles: list[str | None] = []
    for part in partitions:
        mig = gpu.mig(part.gpu_instance, part.compute_instance) if gpu is not None and part.kind == "mig" else None
        profiles.append(mig.profile if mig is not None else None)
    return profiles


def offer_keys(strategy: str, kind: str, partitions: Sequence[Partition], gpu: GpuFacts | None) -> list[str | None]:
    """Where each of a device's offers goes: one per partition (or one for a whole device): its served key, or
    None when it is not offered (mixed: a MIG device whose profile NVML does not give, or gives with a
    character no resource name takes)."""
    if strategy != MIXED or not any(p.kind == "mig" for p in partitions):
        return [kind] * max(1, len(partitions))
    return [profile_key(kind, profile) if profile and nameable(profile) else (kind if part.kind != "mig" else None)
            for part, profile in zip(partitions, partition_profiles(partitions, gpu), strict=True)]


def unnameable_profiles(partitions: Sequence[Partition], gpu: GpuFacts | None) -> list[str]:
    """The partitions' MIG profiles (as NVML names them) that no resource name can take, sorted."""
    return sorted({p for p in partition_profiles(partitions, gpu) if p and not nameable(p)})


def single_mismatch(kind: str, whole: int, profiles: Sequence[str | None]) -> str | None:
    """What NVIDIA's `single` strategy would refuse on a node, offered here under `kind` all the same: MIG
    devices beside whole GPUs, or MIG devices of more than one profile (only those NVML names are compared);
    None when the node is uniform."""
    if not profiles:
        return None
    known = sorted({p for p in profiles if p})
    if whole:
        return (f"{kind}: {len(profiles)} MIG devices and {whole} whole GPUs are all offered as {kind} "
                "(--mig-strategy single; mixed offers one resource per MIG profile)")
    if len(known) > 1:
        return (f"{kind}: MIG devices of profiles {', '.join(known)} are all offered as {kind} "
                "(--mig-strategy single; mixed offers one resource per MIG profile)")
    return None
