"""Co-bound devices (`generate --bundles gpu-nic`): a GPU together with its closest RDMA NIC as one CDI
device, and every GPU and NIC of one NUMA node as another, so a workload asks for `nvidia.com/gpu-nic=0`
or `nvidia.com/gpu-nic=numa0` and gets devices that are close in the PCIe tree. Plain CDI: any runtime that
reads CDI specs understands them.

For each GPU kind that has paired GPUs (see `topology.pair_gpus_with_nics`), a spec `<vendor>/gpu-nic`:
- device `<gpu index>`: the GPU's edits and its paired NIC's edits, with `NCCL_IB_HCA` naming that NIC's
  RDMA device exactly (`=mlx5_0`) and `DEVINJECT_NUMA_NODE` when both report the same NUMA node;
- device `numa<N>`: every GPU of the kind and every NIC on NUMA node N (only nodes the kernel reports),
  `NCCL_IB_HCA` listing the NICs, `DEVINJECT_NUMA_NODE=N`;
- the spec-level edits of both specs (control nodes, driver libraries, hooks).
GPUs without a NIC closer than SYS get no pair device; they are still in their NUMA node's set.
"""

from __future__ import annotations

from dataclasses import dataclass

from devinject.cdi.model import ContainerEdits, Device, Spec
from devinject.discovery.discover import FoundDevice
from devinject.discovery.host import Host
from devinject.discovery.topology import Pair, Topology, label_prefix, topology

BUNDLES = ("gpu-nic",)
NUMA_ENV = "DEVINJECT_NUMA_NODE"


def bundle_kind(gpu_kind: str) -> str:
    return f"{gpu_kind.partition('/')[0]}/gpu-nic"


def possible_bundle_kinds(kinds: set[str], bundles: tuple[str, ...]) -> set[str]:
    """Every bundle kind the GPU kinds among `kinds` could give (a spec dir's manager removes those no longer
    offered, also when it did not write them itself)."""
    if "gpu-nic" not in bundles:
        return set()
    return {bundle_kind(kind) for kind in kinds if label_prefix(kind) == "GPU"}


def rdma_device_name(host: Host, found: FoundDevice) -> str | None:
    """The NIC's RDMA device (`mlx5_0`) from `<function>/infiniband/`, None when the kernel shows none."""
    names = sorted(host.listdir(found.pci.sys_path + "/infiniband"))
    return names[0] if names else None


def _edits_of(spec: Spec, found: FoundDevice) -> ContainerEdits | None:
    wanted = str(found.index)
    return next((d.edits for d in spec.devices if d.name == wanted), None)


def _hints(hcas: list[str], numa: int | None) -> ContainerEdits:
    env = []
    if hcas:
        env.append("NCCL_IB_HCA==" + ",".join(hcas))
    if numa is not None:
        env.append(f"{NUMA_ENV}={numa}")
    return ContainerEdits(env=tuple(env))


def gpu_nic_specs(host: Host, found: list[FoundDevice], specs: list[Spec]) -> list[Spec]:
    """The `<vendor>/gpu-nic` specs for `found` and the per-kind `specs` built from them (none without
    both GPUs and NICs). Their CDI version is the caller's to set."""
    topo: Topology = topology(host, found)
    spec_of = {spec.kind: spec for spec in specs}
    hca = {i: rdma_device_name(host, d) for i, (d, label) in enumerate(zip(topo.devices, topo.labels, strict=True))
           if label.startswith("NIC")}
    bundler = _Bundler(topo, spec_of, hca, [i for i in hca if topo.devices[i].profile.kind in spec_of],
                       {pair.gpu: pair for pair in topo.pairs()})
    gpu_kinds = dict.fromkeys(d.profile.kind for d, label in zip(topo.devices, topo.labels, strict=True)
                              if label.startswith("GPU") and d.profile.kind in spec_of)
    bundles = []
    for kind in gpu_kinds:
        gpus = [i for i, d in enumerate(topo.devices) if d.profile.kind == kind]
        paired, paired_kinds = bundler.pair_devices(kind, gpus)
        sets, set_kinds = bundler.numa_devices(gpus)
        nic_kinds = dict.fromkeys([*paired_kinds, *set_kinds])
        if not nic_kinds:
            continue
        common = spec_of[kind].edits
        for nic_kind in nic_kinds:
            common = common.merge(spec_of[nic_kind].edits)
        bundles.append(Spec(kind=bundle_kind(kind), devices=tuple(paired + sets), edits=common))
    return bundles


@dataclass(frozen=True)
class _Bundler:
    """What each GPU kind's bundle devices are made of: the topology, each kind's spec, the NICs' RDMA device
    names by topology index, the NICs whose kind has a spec, and each paired GPU's pair."""

    topo: Topology
    spec_of: dict[str, Spec]
    hca: dict[int, str | None]
    nic_indices: list[int]
    pairs: dict[int, Pair]

    def pair_devices(self, kind: str, gpus: list[int]) -> tuple[list[Device], list[str]]:
        """Device `<gpu index>` for each of `gpus` with a paired NIC, and the NICs' kinds, in order."""
        topo = self.topo
        devices: list[Device] = []
        nic_kinds: list[str] = []
        for gpu in gpus:
            pair = self.pairs.get(gpu)
            if pair is None or pair.nic not in self.nic_indices:
                continue
            gpu_dev, nic_dev = topo.devices[gpu], topo.devices[pair.nic]
            gpu_edits = _edits_of(self.spec_of[kind], gpu_dev)
            nic_edits = _edits_of(self.spec_of[nic_dev.profile.kind], nic_dev)
            if gpu_edits is None or nic_edits is None:
                continue
            numa = topo.places[gpu].numa if topo.places[gpu].numa == topo.places[pair.nic].numa else None
            hint = _hints([name] if (name := self.hca[pair.nic]) else [], numa)
            devices.append(Device(str(gpu_dev.index), gpu_edits.merge(nic_edits).merge(hint)))
            nic_kinds.append(nic_dev.profile.kind)
        return devices, nic_kinds

    def numa_devices(self, gpus: list[int]) -> tuple[list[Device], list[str]]:
        """Device `numa<N>` for each NUMA node of `gpus` that has a NIC too, and the NICs' kinds, in order."""
        topo = self.topo
        devices: list[Device] = []
        nic_kinds: list[str] = []
        for numa in sorted({n for g in gpus if (n := topo.places[g].numa) is not None}):
            members = [i for i in [*gpus, *self.nic_indices] if topo.places[i].numa == numa]
            if not any(i in self.hca for i in members):
                continue  # a set needs a NIC: without one it would be no gpu-nic bundle
            edits = ContainerEdits()
            for i in members:
                member_kind = topo.devices[i].profile.kind
                member_edits = _edits_of(self.spec_of[member_kind], topo.devices[i])
                if member_edits is not None:
                    edits = edits.merge(member_edits)
                    if i in self.hca:
                        nic_kinds.append(member_kind)
            hcas = [name for i in members if i in self.hca and (name := self.hca[i])]
            devices.append(Device(f"numa{numa}", edits.merge(_hints(hcas, numa))))
        return devices, nic_kinds
