"""Consumable capacity (`DRAConsumableCapacity`, KEP-5075, beta and on in Kubernetes 1.36): where the admin
opts in (`dra-driver --consumable-capacity shares=4,memory=80Gi`, or the `consumable-capacity` key of the
driver's ConfigMap), each whole GPU (one not split into MIG instances) is published with
`allowMultipleAllocations: true` and two capacities the scheduler deducts claims from:

    capacity:
      memory: {value: 80Gi, requestPolicy: {default: 80Gi, validRange: {min: 1Mi, step: 1Mi}}}
      shares: {value: "4", requestPolicy: {default: "1", validRange: {min: "1", max: "4", step: "1"}}}

A claim that asks nothing consumes the whole of the first capacity (memory where it is published, else the
shares), so it still holds the GPU alone; a claim that asks `capacity.requests: {memory: 20Gi}` consumes
that and one share, and the scheduler packs such claims on one GPU (at most `shares` of them) until its
memory is spent. Each allocation of such a device carries a `shareID` and its `consumedCapacity`; the
preparer books it in the ledger as a share (nodestate/ledger.py: shares meet only shares, their amounts never
summing beyond the capacity, whatever the scheduler believed) and names its CDI device after the share.
Pure functions; the documentation is docs/sharing.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from devinject.core.asciitext import is_digits
from devinject.core.errors import DevinjectError

MEMORY, SHARES = "memory", "shares"
MAX_SHARES = 1024
MIB = 2**20
_QUANTITY = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")  # fullmatch: no "4Gi\n"
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
AUTO = "auto"
MINIMUM = {MEMORY: MIB, SHARES: 1}  # each capacity's validRange.min as capacity_json publishes it


class CapacityError(DevinjectError):
    """A consumable-capacity setting or allocation that cannot be used: one line naming it."""


@dataclass(frozen=True, slots=True)
class CapacitySharing:
    """The admin's choice: `shares` claims at most per GPU; `memory` each GPU's memory in bytes (None: none
    published; `auto`: what NVML states of an NVIDIA GPU, else what sysfs does (AMD's VRAM), else none)."""

    shares: int
    memory: int | None = None
    memory_auto: bool = False


def quantity(text: object, where: str) -> int:
    """A whole Kubernetes quantity (`80Gi`, `4`, `1073741824`) as an integer; CapacityError otherwise."""
    if isinstance(text, bool) or not isinstance(text, int | str) or len(str(text)) > 32:
        raise CapacityError(f"{where}: expected a quantity such as 20Gi, got {str(text)[:40]!r}")
    match = _QUANTITY.fullmatch(str(text))
    if match is None:
        raise CapacityError(f"{where}: expected a quantity such as 20Gi, got {str(text)[:40]!r}")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_capacity_sharing(text: str, where: str = "--consumable-capacity") -> CapacitySharing | None:
    """`shares=N[,memory=80Gi|auto]` (empty or `off`: not offered)."""
    if text.strip() in ("", "off"):
        return None
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in (SHARES, MEMORY) or key in fields:
            raise CapacityError(f"{where}: {part.strip()!r}: expected shares=N[,memory=QUANTITY|auto]")
        fields[key] = value.strip()
    if SHARES not in fields:
        raise CapacityError(f"{where}: shares=N is required (how many claims one GPU serves at most)")
    shares = fields[SHARES]
    if not is_digits(shares) or not 1 <= int(shares) <= MAX_SHARES:
        raise CapacityError(f"{where}: shares: expected a whole number from 1 to {MAX_SHARES}, got {shares!r}")
    memory = fields.get(MEMORY)
    if memory == AUTO:
        return CapacitySharing(int(shares), None, True)
    size = None if memory is None else quantity(memory, f"{where}: memory")
    if size is not None and size < MIB:
        raise CapacityError(f"{where}: memory: {memory} is less than 1Mi")
    return CapacitySharing(int(shares), size)


def device_capacity(sharing: CapacitySharing, sysfs_memory: int | None) -> dict[str, int]:
    """The capacities a GPU is published with: memory in MiB units (when known), then shares."""
    memory = sysfs_memory if sharing.memory_auto else sharing.memory
    out: dict[str, int] = {}
    if memory:
        out[MEMORY] = memory // MIB * MIB
    out[SHARES] = sharing.shares
    return out


def binary_quantity(size: int) -> str:
    """`size` bytes as the API server writes a quantity back (its canonical form: the largest binary suffix
    that states it exactly, 40960Mi as 40Gi), so a published slice reads back as it was sent."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if size and size % _UNITS[suffix] == 0:
            return f"{size // _UNITS[suffix]}{suffix}"
    return str(size)


def capacity_json(capacity: dict[str, int]) -> dict[str, object]:
    """The slice's `capacity` of a shareable device, each with its requestPolicy: the first capacity's
    default is all of it (a claim that asks nothing holds the GPU alone), the others' their least."""
    out: dict[str, object] = {}
    for index, (name, value) in enumerate(capacity.items()):
        if name == MEMORY:
            total = binary_quantity(value)
            least = binary_quantity(MINIMUM[MEMORY])
            policy: dict[str, object] = {"default": total if index == 0 else least,
                                         "validRange": {"min": least, "step": least}}
        else:
            total = str(value)
            least = str(MINIMUM[SHARES])
            valid: dict[str, str] = {"min": least, "max": total}
            if value > 1:  # the API wants min + step within the capacity
                valid["step"] = least
            policy = {"default": total if index == 0 else least, "validRange": valid}
        out[name] = {"value": total, "requestPolicy": policy}
    return out


def consumed(result: Mapping[str, object], capacity: dict[str, int], where: str) -> dict[str, int]:
    """A result's `consumedCapacity` in whole units, every capacity of the device named (one the scheduler
    left out consumes its default, as the policy says). A name the device does not publish, an amount beyond
    the capacity, below its published minimum (0 included: ten claims of 0 fit on a full GPU), or a
    malformed one: CapacityError."""
    said = result.get("consumedCapacity")
    if said is None:
        said = {}
    if not isinstance(said, dict) or len(said) > 16:
        raise CapacityError(f"{where}.consumedCapacity: expected an object of capacity name to quantity")
    out: dict[str, int] = {}
    for name, value in said.items():
        if name not in capacity:
            raise CapacityError(f"{where}.consumedCapacity.{str(name)[:40]}: not a capacity of the device "
                                f"(it has {', '.join(capacity)})")
        out[name] = quantity(value, f"{where}.consumedCapacity.{name}")
    for index, name in enumerate(capacity):
        if name not in out:
            out[name] = capacity[name] if index == 0 else MINIMUM.get(name, 1)
    for name, amount in out.items():
        least = MINIMUM.get(name, 1)
        if amount < least:
            raise CapacityError(f"{where}.consumedCapacity.{name}: {amount} is less than the device's minimum "
                                f"{least} (its requestPolicy's validRange)")
        if amount > capacity[name]:
            raise CapacityError(f"{where}.consumedCapacity.{name}: {amount} is more than the device's "
                                f"{capacity[name]}")
    return out


def share_id(result: Mapping[str, object], where: str) -> str | None:
    """A result's `shareID` (a UID the scheduler makes), checked so that it can name a CDI device and a
    ledger booking; None when the result has none."""
    value = result.get("shareID")
    if value is None or value == "":
        return None
    text = str(value)
    if not (isinstance(value, str) and 0 < len(text) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", text)):
        raise CapacityError(f"{where}.shareID: {text[:70]!r} is not a UID")
    return text
