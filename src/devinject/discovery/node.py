"""One node as every command sees it: the roots it was pointed at, checked once; its device profiles,
loaded once; its devices, discovered once; their CDI names and how close they are.

This is discovery's half of the library entry point (`devinject.api.Node` adds health, specs and holders,
which live in the layers above): every layer that needs the node's devices takes one of these instead of
wiring `Host(root) -> load_profiles -> discover` by hand, so no command can read other profiles than another.
"""

from __future__ import annotations

import copy
import posixpath

from devinject.cdi.identity import QualifiedName, device_key, qualified
from devinject.discovery.channels import ChannelDevice, discover_channels
from devinject.discovery.discover import FoundDevice, HostView, discover
from devinject.discovery.host import Host
from devinject.discovery.profiles import Profile, load_profiles
from devinject.discovery.roots import check_roots
from devinject.discovery.topology import Topology, topology

TYPE_CHECKING = False
if TYPE_CHECKING:
    from devinject.discovery.nvml import GpuFacts, NvmlFacts


def device_names(found: FoundDevice, strategies: tuple[str, ...]) -> list[str]:
    """The device's CDI names (without the kind) by each naming strategy: index, uuid (the PCI address for a
    device without a UUID), pci. Default: index and uuid."""
    chosen = strategies or ("index", "uuid")
    names = []
    for strategy in chosen:
        if strategy == "index":
            names.append(str(found.index))
        elif strategy == "uuid":
            names.append(found.uuid or found.address)
        else:
            names.append(found.address)
    return list(dict.fromkeys(names))


class Node:
    """The host under `root` with the profiles of `profile_dirs`; `state_dir` and `kernel_log` are what the
    commands above read of it (None: not used). Each path given is checked when the node is made, in one line
    naming the option (discovery/roots.py); `kernel_log_explicit` says the kernel log was asked for, so that
    it must be there. `host` reuses a Host a caller already holds (the same root). `nvml`: whether NVML is
    asked for its GPUs' facts (None: when the root is /), from the library under `driver_root` (as the host
    names it; None: the host's own)."""

    def __init__(self, root: str = "/", *, target_root: str | None = None, profile_dirs: tuple[str, ...] = (),
                 state_dir: str | None = None, kernel_log: str | None = None, kernel_log_explicit: bool = False,
                 check: bool = True, host: Host | None = None, nvml: bool | None = None,
                 driver_root: str | None = None) -> None:
        if check:
            check_roots(root=root, profile_dirs=profile_dirs, state_dir=state_dir, kernel_log=kernel_log,
                        kernel_log_explicit=kernel_log_explicit)
        self.root = root
        self.target_root = target_root
        self.profile_dirs = tuple(profile_dirs)
        self.state_dir = state_dir
        self.kernel_log = kernel_log
        self.host = host or Host(root)
        self.view = HostView(self.host)
        self._profiles: list[Profile] | None = None
        self._devices: list[FoundDevice] | None = None
        self._channels: list[ChannelDevice] | None = None
        self.nvml = nvml
        self.driver_root = driver_root
        self._nvml: dict[str | None, NvmlFacts] = {}  # by driver root

    @property
    def profiles(self) -> list[Profile]:
        """Shipped, `<root>/etc/devinject/profiles.d`, then each --profile-dir (core/paths.py), read once."""
        if self._profiles is None:
            self._profiles = load_profiles(self.host, self.profile_dirs)
        return self._profiles

    def devices(self) -> list[FoundDevice]:
        """Every device of the node's profiles, discovered once."""
        if self._devices is None:
            self._devices = discover(self.host, self.profiles, view=self.view)
        return self._devices

    def channels(self) -> list[ChannelDevice]:
        """Every device of the node's char-node families (profiles with `channels`: IMEX channels), which match
        no PCI function, discovered once (discovery/channels.py)."""
        if self._channels is None:
            self._channels = discover_channels(self.view, self.profiles)
        return self._channels

    def rescanned(self) -> Node:
        """This node read again (a hot-plug, a driver bound or unbound): the host's caches dropped, a fresh
        view, its devices discovered anew when asked; the roots are not checked again and the profiles are the
        ones already loaded (`watch` rescans with the profiles it started with)."""
        self.host.refresh()
        again = copy.copy(self)
        again.view = HostView(self.host)
        again._devices = None
        again._channels = None
        again._nvml = {}
        return again

    def apart(self) -> Node:
        """This node with a host of its own (its caches another thread's rescans drop: the DRA driver's
        health loop beside its publisher), the profiles already loaded kept."""
        again = self.rescanned()
        again.host = Host(self.root)
        again.view = HostView(again.host)
        return again

    def nvml_facts(self, enabled: bool | None = None, driver_root: str | None = None) -> NvmlFacts:
        """What NVML says of the node's NVIDIA GPUs (discovery/nvml.py), asked once per read of the node (a
        rescan asks again) and only where a device's profile asks NVML (`uuid: {nvml: true}`). `enabled` and
        `driver_root` (None: the node's own) say whether to ask (by default when the root is /) and whose
        library; NO_FACTS when it is not asked, absent or failing (one warning)."""
        from devinject.discovery.nvml import NO_FACTS, node_facts  # a child process's machinery: when asked

        use = next((v for v in (enabled, self.nvml) if v is not None), self.root == "/")
        driver_root = driver_root if driver_root is not None else self.driver_root
        if not use or not any(f.profile.uuid_nvml for f in self.devices()):
            return NO_FACTS
        if driver_root not in self._nvml:
            files = Host(posixpath.join(self.root, driver_root.lstrip("/"))) if driver_root else self.host
            self._nvml[driver_root] = node_facts(files)
        return self._nvml[driver_root]

    def gpu_facts(self, found: FoundDevice) -> GpuFacts | None:
        """NVML's facts of `found` (a GPU of a profile that asks NVML), None without them (nvml_facts)."""
        return self.nvml_facts().gpu(found.address) if found.profile.uuid_nvml else None

    def memory_bytes(self, found: FoundDevice) -> int | None:
        """The device's memory: NVML's total for an NVIDIA GPU, else what sysfs states (AMD's
        `mem_info_vram_total`), else None."""
        gpu = self.gpu_facts(found)
        if gpu is not None and gpu.memory_bytes:
            return gpu.memory_bytes
        vram = self.host.read_attr(found.pci.sys_path + "/mem_info_vram_total")
        return int(vram) if vram and vram.isdigit() and int(vram) > 0 else None

    def topology(self) -> Topology:
        return topology(self.host, self.devices())

    def names(self, found: FoundDevice, strategies: tuple[str, ...] = ()) -> list[QualifiedName]:
        """The device's qualified CDI names, its index name first."""
        return [qualified(found.profile.kind, n) for n in device_names(found, strategies)]

    def name_of(self, kind: str, address: str) -> QualifiedName:
        """The first CDI name of the device of `kind` at `address` (what `list` shows first); its key
        (`kind=address`, the pci strategy's name) for one that is not discovered (an unbound function)."""
        for found in self.devices():
            if found.profile.kind == kind and found.address == address:
                return self.names(found)[0]
        return QualifiedName(device_key(kind, address))

    def find(self, device: str) -> list[FoundDevice]:
        """The devices `device` names: its key (kind=PCI address), a PCI address of one of its functions, one
        of its CDI names, or a CDI name without the kind (`0`, a UUID: every kind's device of that name)."""
        matches = []
        for found in self.devices():
            names = self.names(found)
            if device in (device_key(found.profile.kind, found.address), *(f.address for f in found.functions),
                          *names, *(n.partition("=")[2] for n in names)):
                matches.append(found)
        return matches

    def find_channels(self, device: str) -> list[ChannelDevice]:
        """The channels `device` names: its CDI name (`nvidia.com/imex-channel=0`, which is also its key) or
        that name without the kind (`0`: every family's channel of that number)."""
        return [c for c in self.channels() if device in (c.key, c.name)]

    def why_no_devices(self, kinds: tuple[str, ...] = ()) -> str:
        """One line on what this node has instead of devices (of `kinds`): discovery/absence.py."""
        from devinject.discovery.absence import why_no_devices

        return why_no_devices(self.host, self.profiles, self.devices(), self.root, kinds)
