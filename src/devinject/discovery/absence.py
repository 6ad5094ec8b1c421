"""Why a node shows no devices (or none of the kinds asked for), in one line an admin can act on.

"no devices found" is true of a wrong `--root`, of a VM without accelerators, of GPUs whose driver is not
bound and of a driver whose nodes were never made alike; each needs another fix. This names what was looked
at (the root's PCI bus) and what was found there instead.
"""

from __future__ import annotations

from collections import Counter

from devinject.discovery.discover import FoundDevice, family_of
from devinject.discovery.host import Host
from devinject.discovery.profiles import Profile, select_profile
from devinject.discovery.sysfs import PCI_DEVICES, scan_pci


def _counted(counts: Counter[str]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def why_no_devices(host: Host, profiles: list[Profile], devices: list[FoundDevice], root: str,
                   kinds: tuple[str, ...] = ()) -> str:
    """What the host under `root` (or, with `kinds`, its devices of those kinds) has instead of devices: one
    line, no trailing period. Call it when the node offered nothing (of `kinds`)."""
    wanted = set(kinds)
    asked = f"no {', '.join(sorted(wanted))} devices" if wanted else "no devices"
    where = host.real(PCI_DEVICES)
    if not host.is_dir(PCI_DEVICES):
        return (f"{asked}: {where} does not exist, so this is not a host's root "
                f"(--root {root}: a host's /, or a fixture such as tests/fixtures/hosts/hgx-h100)")
    functions = scan_pci(host)
    offered = Counter(d.profile.kind for d in devices)
    unbound: Counter[str] = Counter()
    no_nodes: Counter[str] = Counter()
    offered_addresses = {f.address for d in devices for f in d.functions}
    for pci in functions:
        profile = select_profile(profiles, pci)
        if profile is None:
            family = family_of(profiles, pci)
            if family is not None and (not wanted or family.kind in wanted):
                unbound[family.kind] += 1
        elif pci.address not in offered_addresses and (not wanted or profile.kind in wanted):
            no_nodes[profile.kind] += 1
    known = {p.kind for p in profiles}
    problems = []
    if unbound:
        problems.append(f"functions of {_counted(unbound)} with no driver bound (or a foreign one)")
    if no_nodes:
        problems.append(f"{_counted(no_nodes)} bound but without their device nodes")
    if problems:
        return f"{asked}: {'; '.join(problems)} under {where}: `devinject health` or `devinject doctor` says why"
    if wanted:
        unknown = sorted(wanted - known)
        if unknown:
            return (f"{asked}: {', '.join(unknown)} is no kind of the loaded profiles "
                    f"(known: {', '.join(sorted(known))})")
        if offered:
            return f"{asked} under {where}; found instead: {_counted(offered)}"
    return f"{asked}: {len(functions)} PCI functions under {where}, none of a known device family"
