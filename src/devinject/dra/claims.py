"""Preparing a ResourceClaim: its allocation for this driver -> one claim-scoped CDI spec, built by the spec
pipeline `generate` uses (specs/generate.py build_specs: no second pipeline), booked in the node's ledger and
remembered in a checkpoint (docs/dra.md).

A prepare is a plan and its effects: `Preparer.plan_claim` computes everything (devices, sharing, shares,
bookings, the spec's bytes, the device metadata, the checkpoint's `ClaimRecord`) and writes nothing; the
effects (`Preparer._effects`: metadata, spec, booking, MPS daemon, time slices, checkpoint) are applied in
that order by core/undo.py, each pushing its undo, so a failure after any of them undoes exactly what was
done. A crash between them is harmless: at start any claim spec of this driver the checkpoint does not name is
removed with its booking. Unprepare removes the claim's pieces and its checkpoint entry last. Both are
idempotent: the kubelet retries.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from devinject.agent.mps import LOG_IN_CONTAINER, PIPE_IN_CONTAINER, Daemon, MpsDaemons, MpsError
from devinject.agent.timeslice import TimesliceError, apply_timeslice
from devinject.cdi.identity import NodeId, node_id_of
from devinject.cdi.model import ContainerEdits, Device, Mount, Spec
from devinject.cdi.spec import dump
from devinject.core import jsonlite
from devinject.core.atomicfile import replace as replace_file
from devinject.core.errors import DevinjectError, LedgerError
from devinject.core.undo import Effect, apply_all, nothing
from devinject.discovery.discover import FoundDevice
from devinject.discovery.node import Node
from devinject.dra.capacity import CapacityError, consumed, share_id
from devinject.dra.devicemetadata import MetadataDevice, MetadataFile, MetadataFiles, with_mounts
from devinject.dra.gpuconfig import MPS, TIME_SLICING, GpuConfigError, GpuSharing, request_sharing
from devinject.dra.slices import Offer
from devinject.linux.filelock import NodeLock
from devinject.linux.trusteddir import write_file
from devinject.nodestate.claimcheckpoints import (
    NODE_PID,
    CheckpointBooking,
    CheckpointDevice,
    ClaimRecord,
    DraCheckpoint,
    booking_id,
    checkpoint_path,
    parse_checkpoint,
)
from devinject.nodestate.ledger import PLUGIN_PREFIX, Claim, Ledger
from devinject.nodestate.statefile import MAX_BYTES, StateFileError, UnreadableStateFile, problem_in, read_bytes
from devinject.specs.generate import EditsMemo, GenerateOptions, build_specs, versioned

log = logging.getLogger(__name__)

CLAIM_CLASS = "claim"
POD_GROUPS = ("scheduling.k8s.io", "podgroups")  # a reservedFor consumer that is a PodGroup: (apiGroup, resource)
CLAIMS_LOCK_TIMEOUT = 30.0  # seconds a claim waits for another prepare on the node (an MPS daemon's start)


class PrepareError(DevinjectError):
    """A claim that cannot be prepared (or unprepared): the message goes to the kubelet, and the pod's events."""


class CheckpointError(PrepareError):
    pass


class ClaimReadError(PrepareError):
    """The claim could not be read from the API server: `status` is the HTTP status (404: it is gone; 0: no
    answer came)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Contest:
    """A claim whose prepare the ledger refused: allocated on this node on a device another booking holds
    (the device plugin gave it to a pod in the instant the scheduler allocated the claim on it). Its identity
    and the (pool, device) its allocation names: the driver keeps a device the plugin holds in its slice,
    tainted NoExecute, while such a claim points at it (dra/driver.py contested_offers)."""

    namespace: str
    name: str
    devices: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None  # the allocation's share of a device claims consume capacity of


@dataclass(frozen=True, slots=True)
class Inventory:
    """What the driver offers now: its node (for the spec pipeline) and its offers by (pool, device)."""

    node: Node
    offers: dict[tuple[str, str], Offer]


class Checkpoint:
    """The prepared claims, one JSON file in the state dir, replaced atomically (fsynced: it must outlive a
    crash of the driver, which is when it is read). Its format, version and checksum are
    nodestate/claimcheckpoints.py's (`DraCheckpoint`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self) -> dict[str, ClaimRecord]:
        try:  # the state files' one rule: whole, up to their size cap
            raw = self.raw()
            return {} if raw is None else parse_checkpoint(raw, self.path).claims
        except StateFileError as err:
            raise CheckpointError(f"{self.path}: corrupt checkpoint ({problem_in(err, self.path)}); no claim is "
                                  "prepared until it is repaired or removed") from None

    def raw(self) -> bytes | None:
        """The file's bytes as they are now; None when there is none."""
        try:
            return read_bytes(self.path, what="the checkpoint", max_bytes=MAX_BYTES)
        except UnreadableStateFile as err:
            raise CheckpointError(err.message) from None

    def save(self, claims: Mapping[str, ClaimRecord]) -> None:
        self._write(DraCheckpoint(dict(claims)).encode())

    def restore(self, raw: bytes | None) -> None:
        """The file as raw() read it (None: none), byte for byte: a failed prepare's undo."""
        if raw is None:
            Path(self.path).unlink(missing_ok=True)
        else:
            self._write(raw)

    def _write(self, data: bytes) -> None:
        try:
            replace_file(self.path, data, 0o600, sync=True)
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot write the checkpoint: {err.strerror}") from None


def allocation_devices(claim: Mapping[str, object]) -> object:
    """The claim's `status.allocation.devices` (results and config), None where the path is missing."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, dict) else None
    return allocation.get("devices") if isinstance(allocation, dict) else None


def allocated(claim: Mapping[str, object], driver: str, namespace: str, name: str,
              uid: str) -> list[tuple[str, str, str]]:
    """(request, pool, device) of the claim's allocation for `driver`. PrepareError when the object is not
    the claim the kubelet means, or not allocated. Its opaque config: claim_sharing."""
    what = f"claim {namespace}/{name}"
    meta = claim.get("metadata")
    got = meta.get("uid") if isinstance(meta, dict) else None
    if got != uid:
        raise PrepareError(f"{what}: the API has uid {got}, the kubelet asked for {uid} (deleted and re-created?)")
    devices = allocation_devices(claim)
    if not isinstance(devices, dict):
        raise PrepareError(f"{what}: not allocated (status.allocation.devices is missing)")
    out = []
    for index, result in enumerate(devices.get("results") or []):
        if not isinstance(result, dict):
            raise PrepareError(f"{what}: status.allocation.devices.results[{index}]: not an object")
        if result.get("driver") != driver:
            continue
        fields = [result.get(k) for k in ("request", "pool", "device")]
        if not all(isinstance(f, str) and f for f in fields):
            raise PrepareError(f"{what}: status.allocation.devices.results[{index}]: request, pool and device "
                               "must be names")
        out.append((str(fields[0]), str(fields[1]), str(fields[2])))
    return out


def result_shares(claim: Mapping[str, object], driver: str, namespace: str,
                  name: str) -> list[tuple[str | None, Mapping[str, object]]]:
    """Each of `driver`'s results (in allocated()'s order): its shareID (None: the device is the claim's
    alone) and the result itself, for its consumedCapacity. PrepareError on a shareID that is not a UID."""
    devices = allocation_devices(claim)
    results = devices.get("results") if isinstance(devices, dict) else None
    out: list[tuple[str | None, Mapping[str, object]]] = []
    for index, result in enumerate(results if isinstance(results, list) else ()):
        if isinstance(result, dict) and result.get("driver") == driver:
            try:
                out.append((share_id(result, f"claim {namespace}/{name}: status.allocation.devices.results"
                                             f"[{index}]"), result))
            except CapacityError as err:
                raise PrepareError(err.message) from None
    return out


def admin_access(claim: Mapping[str, object], driver: str) -> set[tuple[str, str]]:
    """(pool, device) of `driver`'s results allocated with `adminAccess: true` (monitoring, in a namespace
    labelled `resource.kubernetes.io/admin-access`): the scheduler gives such a device to other claims too, so
    the claim gets access but books nothing, and never keeps a workload from the device."""
    devices = allocation_devices(claim)
    results = devices.get("results") if isinstance(devices, dict) else None
    return {(str(r.get("pool")), str(r.get("device"))) for r in (results if isinstance(results, list) else ())
            if isinstance(r, dict) and r.get("driver") == driver and r.get("adminAccess") is True}


def claim_sharing(claim: Mapping[str, object], driver: str, namespace: str, name: str,
                  requests: list[str]) -> dict[str, GpuSharing]:
    """Each request's sharing from the claim's opaque configs for `driver` (dra/gpuconfig.py GpuConfig; any
    other kind is refused, never silently ignored): PrepareError naming the config and the field."""
    devices = allocation_devices(claim)
    configs = devices.get("config") if isinstance(devices, dict) else None
    try:
        return request_sharing(configs, driver, f"claim {namespace}/{name}: status.allocation.devices", requests)
    except GpuConfigError as err:
        raise PrepareError(err.message) from None


def mps_env(sharing: GpuSharing, pipe_dir: str, log_dir: str) -> ContainerEdits:
    """What a container of an MPS claim needs: the daemon's pipe and log directories mounted where CUDA looks
    (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY) and the claim's limits as the client's env."""
    from devinject.cdi.model import Mount

    env = [f"CUDA_MPS_PIPE_DIRECTORY={PIPE_IN_CONTAINER}", f"CUDA_MPS_LOG_DIRECTORY={LOG_IN_CONTAINER}"]
    settings = sharing.mps
    if settings is not None and settings.active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={settings.active_thread_percentage}")
    if settings is not None and (settings.pinned_memory_limit_mb is not None or settings.per_device_limit_mb):
        limits = {"0": settings.pinned_memory_limit_mb} if settings.pinned_memory_limit_mb is not None else {}
        limits.update(settings.per_device_limit_mb)
        env.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{k}={v}M" for k, v in sorted(limits.items())))
    # The log directory is the root daemon's to write: read-only, so that no pod plants a link there for the
    # daemon to follow on the host. Clients connect through the pipe directory, which they must write.
    pipe = ("rbind", "rw", "nosuid", "nodev", "noexec")
    logs = ("rbind", "ro", "nosuid", "nodev", "noexec")
    return ContainerEdits(env=tuple(env), mounts=(
        Mount(host_path=pipe_dir, container_path=PIPE_IN_CONTAINER, options=pipe),
        Mount(host_path=log_dir, container_path=LOG_IN_CONTAINER, options=logs)))


def reserved_pods(claim: Mapping[str, object]) -> tuple[str, ...]:
    """The UIDs of the pods a claim is reserved for (`status.reservedFor[]` entries of core `pods`): the only
    containers whose bookings of its devices are no clash with the claim's (their cgroups name the pod)."""
    status = claim.get("status")
    consumers = status.get("reservedFor") if isinstance(status, dict) else None
    pods = []
    for consumer in consumers if isinstance(consumers, list) else ():
        if isinstance(consumer, dict) and consumer.get("resource") == "pods" and not consumer.get("apiGroup") \
                and isinstance(consumer.get("uid"), str) and consumer["uid"]:
            pods.append(consumer["uid"])
    return tuple(sorted(set(pods)))


def reserved_groups(claim: Mapping[str, object]) -> tuple[str, ...]:
    """The names of the PodGroups a claim is reserved for (DRAWorkloadResourceClaims: `status.reservedFor[]`
    entries of `scheduling.k8s.io` `podgroups`, in the claim's namespace): their pods share the claim."""
    status = claim.get("status")
    consumers = status.get("reservedFor") if isinstance(status, dict) else None
    return tuple(sorted({c["name"] for c in (consumers if isinstance(consumers, list) else ())
                         if isinstance(c, dict) and c.get("apiGroup") == POD_GROUPS[0]
                         and c.get("resource") == POD_GROUPS[1] and isinstance(c.get("name"), str) and c["name"]}))


def group_members(pods: object, group: str) -> tuple[str, ...]:
    """The UIDs of the pods of a pod list (the API's answer) whose `spec.schedulingGroup.podGroupName` is
    `group`: the PodGroup's members."""
    items = pods.get("items") if isinstance(pods, dict) else None
    members = []
    for pod in items if isinstance(items, list) else ():
        meta, spec = (pod.get("metadata"), pod.get("spec")) if isinstance(pod, dict) else (None, None)
        scheduling = spec.get("schedulingGroup") if isinstance(spec, dict) else None
        if isinstance(scheduling, dict) and scheduling.get("podGroupName") == group and isinstance(meta, dict) \
                and isinstance(meta.get("uid"), str) and meta["uid"]:
            members.append(meta["uid"])
    return tuple(sorted(set(members)))


def _chosen(offers: list[Offer]) -> list[FoundDevice]:
    """The PCI devices the spec pipeline builds for these offers: a whole device as itself, the partitions of
    one device together (its others left out); a channel is none (its profile's channel spec holds it)."""
    whole: dict[str, FoundDevice] = {}
    parts: dict[str, FoundDevice] = {}
    for offer in offers:
        if offer.channel is not None:
            continue
        key = f"{offer.kind}={offer.device.address}"
        if offer.partition is None:
            whole[key] = offer.device
        else:
            held = parts.get(key)
            partitions = (*(held.partitions if held else ()), offer.partition)
            parts[key] = replace(offer.device, partitions=partitions)
    return [*whole.values(), *parts.values()]


def _ledger_claim(offer: Offer, edits: ContainerEdits) -> Claim:
    """A device's nodes; a partition's nodes its sibling partitions also use (the parent GPU, shared caps)
    are booked shared, as the hook books them."""
    nodes = tuple(node_id_of(n) for n in edits.device_nodes)
    shared: tuple[str, ...] = ()
    if offer.partition is not None:
        siblings = {node_id_of(n) for p in offer.device.partitions if p != offer.partition for n in p.nodes}
        shared = tuple(n for n in nodes if n in siblings or n == node_id_of(offer.partition.nodes[0]))
    return Claim(f"{offer.kind}={offer.name}", nodes, shared)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """The claim the kubelet names."""

    namespace: str
    name: str
    uid: str

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def what(self) -> str:
        return f"claim {self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class TimeSlice:
    """A whole GPU's time slice a TimeSlicing request sets: its PCI address, UUID and interval."""

    gpu: str
    uuid: str
    interval: str


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """A claim's prepare as Preparer.plan_claim computes it, before anything is written: what its effects
    (Preparer._effects) put on the node, and what the kubelet is answered."""

    ref: ClaimRef
    path: str  # its CDI spec file
    spec: bytes  # the spec, with its device metadata's mounts
    metadata: tuple[MetadataFile, ...]  # KEP-5304's files, when the driver writes them
    booking: tuple[Claim, ...]
    pods: tuple[str, ...]  # the pods it is reserved for (its PodGroups' too)
    consumes: dict[str, dict[str, list[int]]] | None  # node -> capacity -> [amount, total] of its shares
    mps: dict[str, str]  # GPU address -> what its MPS daemon's CUDA_VISIBLE_DEVICES names it by
    timeslices: tuple[TimeSlice, ...]
    devices: tuple[PreparedDevice, ...]
    record: ClaimRecord  # the checkpoint's
    contest: Contest  # remembered when the ledger refuses the booking


def _offers(inventory: Inventory, results: list[tuple[str, str, str]], what: str) -> list[Offer]:
    offers = []
    for _, pool, device in results:
        offer = inventory.offers.get((pool, device))
        if offer is None:
            raise PrepareError(f"{what}: device {pool}/{device} is not one this node offers (its ResourceSlices "
                               "are older than the hardware, or not ours)")
        offers.append(offer)
    return offers


def _consumed(what: str, results: list[tuple[str, str, str]], shares: list[tuple[str | None, Mapping[str, object]]],
              offers: list[Offer]) -> list[dict[str, int] | None]:
    """Each result's consumed capacity (None: not a share). A share of a device this node does not offer
    by consumable capacity now (the admin turned it off; a stale slice) is refused: its totals are not
    known, and a device held as a share must be counted."""
    out: list[dict[str, int] | None] = []
    for index, ((request, pool, device), (share, result), offer) in enumerate(zip(results, shares, offers,
                                                                                   strict=True)):
        if share is None:
            out.append(None)
            continue
        if not offer.shareable:
            raise PrepareError(f"{what}: request {request}: {pool}/{device} is allocated as share {share}, but "
                               "this node does not offer it by consumable capacity (--consumable-capacity)")
        try:
            out.append(consumed(result, dict(offer.shareable), f"{what}: status.allocation.devices.results[{index}]"))
        except CapacityError as err:
            raise PrepareError(err.message) from None
    return out


def _timeslices(what: str, results: list[tuple[str, str, str]], offers: list[Offer],
                sharing: dict[str, GpuSharing]) -> tuple[TimeSlice, ...]:
    """The time slice of each GPU a TimeSlicing request holds, to be set as its interval says
    (agent/timeslice.py, as NVIDIA's driver: Default too, which puts back what another claim set). Whole GPUs
    only: a MIG instance has no time slice of its own."""
    out = []
    for (request, _, _), offer in zip(results, offers, strict=True):
        settings = sharing.get(request)
        if settings is None or settings.strategy != TIME_SLICING or offer.found is None:
            continue
        if offer.partition is not None:
            if settings.interval != "Default":
                raise PrepareError(f"{what}: request {request}: timeSlicingConfig.interval {settings.interval}: a "
                                   f"time slice is set for whole GPUs, not {offer.name}")
            continue
        out.append(TimeSlice(offer.device.address, offer.device.uuid or "", settings.interval))
    return tuple(out)


def _bookings(offers: list[Offer], edits: list[ContainerEdits], amounts: list[dict[str, int] | None],
              shares: list[tuple[str | None, Mapping[str, object]]],
              admin: set[tuple[str, str]]) -> tuple[tuple[Claim, ...], dict[str, dict[str, list[int]]]]:
    """The claim's ledger bookings (a share's named `<device>@<share>`; an admin-access device's with no
    nodes) and its shares' consumed capacity by node (a claim's shares of one device add up)."""
    booked = tuple(Claim(f"{o.kind}={o.name}", (), ()) if (o.pool, o.name) in admin else _ledger_claim(o, e)
                   for o, e in zip(offers, edits, strict=True))
    consumes: dict[str, dict[str, list[int]]] = {}
    for offer, claimed, used in zip(offers, booked, amounts, strict=True):
        if used is None or (offer.pool, offer.name) in admin:
            continue
        for node in claimed.nodes:
            caps = consumes.setdefault(str(node), {})
            for cap, amount in used.items():
                caps[cap] = [caps.get(cap, [0])[0] + amount, dict(offer.shareable)[cap]]
    return tuple(Claim(f"{c.name}@{share}", c.nodes, c.shared) if share is not None else c
                 for c, (share, _) in zip(booked, shares, strict=True)), consumes


def _visible_name(offers: list[Offer], gpu: str) -> str:
    """What an MPS daemon's CUDA_VISIBLE_DEVICES names the GPU by: its UUID, else its index."""
    offer = next(o for o in offers if o.found is not None and o.device.address == gpu)
    return offer.device.uuid or str(offer.device.index)


def _first_of_requests(results: list[tuple[str, str, str]], files: tuple[MetadataFile, ...]) -> dict[int, Mount]:
    """Each request's metadata mount by the index of the request's first device (every container given the
    request gets it)."""
    first: dict[str, int] = {}
    for index, (request, _, _) in enumerate(results):
        first.setdefault(request.partition("/")[0], index)
    return {first[file.request]: file.mount for file in files}


class Preparer:
    """NodePrepareResources / NodeUnprepareResources for one driver, serialized (the kubelet may call both
    at once, and more than once)."""

    def __init__(self, driver: str, cdi_dir: str, state_dir: str, inventory: Callable[[], Inventory],
                 get_claim: Callable[[str, str], Mapping[str, object]], generate: GenerateOptions,
                 ledger: Ledger | None = None, mps: MpsDaemons | None = None,
                 group_pods: Callable[[str, str], tuple[str, ...]] | None = None,
                 metadata: MetadataFiles | None = None) -> None:
        self.driver = driver
        driver_root = self.driver_root = os.path.join(generate.root, (generate.driver_root or "/").lstrip("/"))
        self.mps = mps if mps is not None else MpsDaemons(state_dir, driver_root)
        self.cdi_dir = cdi_dir
        self.inventory = inventory
        self.get_claim = get_claim
        self.group_pods = group_pods  # (namespace, PodGroup) -> the UIDs of its pods on this node
        self.metadata = metadata  # KEP-5304's files, when the driver writes them (dra/devicemetadata.py)
        self.generate = generate
        self.ledger = ledger if ledger is not None else Ledger(state_dir)
        self.checkpoint = Checkpoint(checkpoint_path(state_dir, driver))  # the ledger's rebuild reads it too
        # one claim's change at a time on the node: during a rolling update two driver pods share this state dir
        self.lock = NodeLock(self.checkpoint.path + ".lock", timeout=CLAIMS_LOCK_TIMEOUT, what="claims")
        self.edits = EditsMemo()  # the driver's files as read for the last claim: _spec, under the lock
        self.contests: dict[str, Contest] = {}  # claim uid -> refused on a held device, until it is gone
        self.contests_changed = threading.Event()  # set when one is added or dropped: publish again

    @property
    def kind(self) -> str:
        return f"{self.driver}/{CLAIM_CLASS}"

    def spec_path(self, uid: str) -> str:
        """The one file a claim's spec is and the only one the driver ever removes for it (a path a
        checkpoint names is never trusted: it is state a corrupt or planted file could make say anything)."""
        return os.path.join(self.cdi_dir, f"{self.driver}-{checked_uid(uid)}.json")

    def booking(self, uid: str) -> str:
        return booking_id(self.driver, uid)

    # --- prepare ----------------------------------------------------------------------------------------
    def _known(self, uid: str) -> tuple[dict[str, ClaimRecord], list[PreparedDevice] | None]:
        """The checkpoint's claims, and what `uid` was prepared as when it was (and its spec is still there)."""
        claims = self.checkpoint.load()
        record = claims.get(uid)
        if record is not None and os.path.exists(self.spec_path(uid)):
            return claims, [PreparedDevice(d.requests, d.pool, d.device, d.cdi, d.share or None)
                            for d in record.devices]
        return claims, None

    def prepare(self, namespace: str, name: str, uid: str) -> list[PreparedDevice]:
        """The claim planned (plan_claim: nothing written) and its plan applied, effect by effect
        (_effects: a failure undoes exactly those done). A claim already prepared is answered from the
        checkpoint."""
        with self.lock:
            self.spec_path(uid)  # the uid checked before anything is read or written
            _checked_name(namespace, name)
            _, known = self._known(uid)
        if known is not None:
            return known
        # the API server is asked with no lock held: a slow answer for one claim delays no other claim's prepare
        # or unprepare, and a prepared claim is answered from the checkpoint while the API server is away
        began = time.monotonic()
        claim = self.get_claim(namespace, name)
        read = time.monotonic() - began
        members = self._group_members(claim, namespace, name)  # asked only for a claim a PodGroup holds
        with self.lock:
            claims, known = self._known(uid)  # a call of the kubelet's that came in meanwhile prepared it
            if known is not None:
                return known
            plan = self.plan_claim(claim, members, self.inventory(), claims, ClaimRef(namespace, name, uid))
            self._apply(plan, claims)
            # the split says whether a slow prepare is the API server's or the node's
            log.info("prepared claim %s/%s (%s) in %.1f ms, %.1f of them reading it: %s", namespace, name, uid,
                     (time.monotonic() - began) * 1000, read * 1000,
                     ", ".join(f"{d.pool}/{d.device}" for d in plan.devices) or "no devices of this driver")
            return list(plan.devices)

    def plan_claim(self, claim: Mapping[str, object], members: tuple[str, ...], inventory: Inventory,
                   claims: Mapping[str, ClaimRecord], ref: ClaimRef) -> ClaimPlan:
        """What preparing the claim does, computed and checked with nothing written: its devices, their
        sharing, offers, shares and bookings, the CDI spec's bytes, its device metadata and the checkpoint's
        record. PrepareError (or MetadataError) naming the claim when it cannot be prepared."""
        results = allocated(claim, self.driver, ref.namespace, ref.name, ref.uid)
        sharing = claim_sharing(claim, self.driver, ref.namespace, ref.name, [r for r, _, _ in results])
        offers = _offers(inventory, results, ref.what)
        shares = result_shares(claim, self.driver, ref.namespace, ref.name)
        amounts = _consumed(ref.what, results, shares, offers)
        labels = [o.name if share is None else f"{o.name}-{share}" for o, (share, _) in zip(offers, shares,
                                                                                            strict=True)]
        mps_gpus = self._mps_gpus(ref, results, offers, sharing)
        _same_sharing(ref.what, claims, offers, shares, set(mps_gpus))
        timeslices = _timeslices(ref.what, results, offers, sharing)
        extra = {gpu: mps_env(sharing[request], daemon.pipe_dir, daemon.log_dir)
                 for gpu, (request, daemon) in mps_gpus.items()}
        spec, edits = self._spec(inventory.node, ref.uid, offers, extra, labels)
        files = self._metadata_files(claim, ref, results, offers)
        spec = with_mounts(spec, _first_of_requests(results, files))
        path = self.spec_path(ref.uid)
        from devinject.specs.validate import validate_spec

        validate_spec(spec, source=path)
        booked, consumes = _bookings(offers, edits, amounts, shares, admin_access(claim, self.driver))
        # request names as the kubelet matches containers' claims: a subrequest's (firstAvailable) base
        devices = tuple(PreparedDevice((request.partition("/")[0],), offer.pool, offer.name,
                                       (f"{self.kind}={ref.uid}-{label}",), share)
                        for (request, _, _), offer, label, (share, _) in zip(results, offers, labels, shares,
                                                                             strict=True))
        pods = tuple(sorted(set(reserved_pods(claim)) | set(members)))
        visible = {gpu: _visible_name(offers, gpu) for gpu in mps_gpus}
        record = ClaimRecord(
            path, tuple(CheckpointDevice(d.requests, d.pool, d.device, d.cdi_ids, d.share_id) for d in devices),
            ref.namespace, ref.name, pods, tuple(CheckpointBooking(c.name, c.nodes, c.shared) for c in booked),
            {r: s.to_json() for r, s in sharing.items() if s.strategy != "Exclusive"}, visible,
            {node: {cap: (pair[0], pair[1]) for cap, pair in caps.items()} for node, caps in consumes.items()}
            if consumes else None)
        return ClaimPlan(ref, path, dump(spec, "json").encode(), files, booked, pods, consumes or None, visible,
                         timeslices, devices, record, Contest(ref.namespace, ref.name,
                                                              tuple((o.pool, o.name) for o in offers)))

    def _effects(self, plan: ClaimPlan, claims: Mapping[str, ClaimRecord]) -> list[Effect]:
        """The plan's changes to the node, in order, each with its undo: the device metadata and the spec,
        the booking, the MPS daemons, the time slices, and the checkpoint last (what a crash leaves before it,
        the driver's start removes: clean_orphans)."""
        uid, before = plan.ref.uid, self.checkpoint.raw()
        metadata = self.metadata
        effects = [Effect("metadata", partial(metadata.write_files, uid, plan.metadata, plan.ref.label),
                          partial(metadata.remove, uid))] if metadata is not None and plan.metadata else []
        effects.append(Effect("spec", partial(write_file, plan.path, plan.spec, 0o644, what="claim's CDI spec",
                                              error=PrepareError, sync=True), partial(_remove, plan.path)))
        effects.append(Effect("booking", partial(self._book, plan), partial(self._unbook, uid)))
        effects += [Effect(f"mps {gpu}", partial(self.mps.acquire, gpu, uid, visible), partial(self.mps.release,
                                                                                                 gpu, uid))
                    for gpu, visible in plan.mps.items()]  # after the booking: the GPU is this claim's
        effects += [Effect(f"timeslice {slice_.gpu}", partial(self._timeslice, plan.ref, slice_), nothing)
                    for slice_ in plan.timeslices]  # a time slice set stays, as NVIDIA's driver leaves it
        effects.append(Effect("checkpoint", partial(self.checkpoint.save, {**claims, uid: plan.record}),
                              partial(self.checkpoint.restore, before)))
        return effects

    def _apply(self, plan: ClaimPlan, claims: Mapping[str, ClaimRecord]) -> None:
        """The plan's effects applied; on any failure (a bug too) those done are undone, in reverse, and the
        failure is the claim's: a booking the ledger refused is remembered as a contest."""
        try:
            apply_all(self._effects(plan, claims))
        except LedgerError as err:
            if self.contests.get(plan.ref.uid) != plan.contest:
                self.contests[plan.ref.uid] = plan.contest
                self.contests_changed.set()
            raise PrepareError(f"{plan.ref.what}: {err.message}") from None
        except (MpsError, TimesliceError) as err:
            raise PrepareError(f"{plan.ref.what}: {err.message}") from None

    def _book(self, plan: ClaimPlan) -> None:
        self.ledger.book(self.booking(plan.ref.uid), NODE_PID, plan.booking, for_pods=plan.pods,
                         consumes=plan.consumes)
        self._drop_contest(plan.ref.uid)

    def _unbook(self, uid: str) -> None:
        """The claim's booking released and finished now (a MIG instance holds its GPU's node shared: a
        booking finishes only releases that hold a node it wants exclusively, so the sweep does it)."""
        if self.ledger.release(self.booking(uid)) == "released":
            self.ledger.sweep()

    def _timeslice(self, ref: ClaimRef, slice_: TimeSlice) -> None:
        if apply_timeslice(self.driver_root, slice_.gpu, slice_.uuid, slice_.interval):
            log.info("claim %s: %s time slice %s", ref.label, slice_.gpu, slice_.interval)

    def _mps_gpus(self, ref: ClaimRef, results: list[tuple[str, str, str]], offers: list[Offer],
                  sharing: dict[str, GpuSharing]) -> dict[str, tuple[str, Daemon]]:
        """GPU address -> (its request, the claim's own daemon's directories) for the claim's MPS requests:
        whole GPUs, one per claim (a CUDA client has one CUDA_MPS_PIPE_DIRECTORY, and a claim one daemon)."""
        out: dict[str, tuple[str, Daemon]] = {}
        for (request, _, _), offer in zip(results, offers, strict=True):
            settings = sharing.get(request)
            if settings is None or settings.strategy != MPS:
                continue
            if offer.found is None or offer.partition is not None:
                raise PrepareError(f"{ref.what}: request {request}: MPS is for whole GPUs, not {offer.name}")
            out[offer.device.address] = (request, self.mps.daemon(ref.uid))
            limits = settings.mps.per_device_limit_mb if settings.mps else {}
            if any(key != "0" for key in limits):
                raise PrepareError(f"{ref.what}: request {request}: defaultPerDevicePinnedMemoryLimit: "
                                   "the claim's one MPS GPU is device 0")
        if len(out) > 1:
            raise PrepareError(f"{ref.what}: MPS on {len(out)} GPUs in one claim: one GPU per MPS "
                               "claim (a claim has one daemon, a container one CUDA_MPS_PIPE_DIRECTORY)")
        return out

    def _spec(self, node: Node, uid: str, offers: list[Offer], extra: dict[str, ContainerEdits] | None = None,
              labels: list[str] | None = None) -> tuple[Spec, list[ContainerEdits]]:
        """One spec of kind `<driver>/claim`: a device `<uid>-<label>` per offer (the device's name, and a
        share's ID after it: two shares of one device are two CDI devices) with that device's edits as
        `generate` builds them, and the edits of every kind it holds (libraries, binaries) once for all. A
        channel's device is the one its profile's channel spec (specs/generate.py channel_spec) names `N`."""
        from devinject.discovery.node import device_names

        chosen = _chosen(offers)
        profiles = list({**{f.profile.name: f.profile for f in chosen},
                         **{o.channel.profile.name: o.channel.profile for o in offers if o.channel}}.values())
        specs = {s.kind: s for s in build_specs(node.host, profiles, chosen, self.generate, node.view, self.edits)}
        common = ContainerEdits()
        for spec in specs.values():
            common = common.merge(spec.edits)
        devices, edits = [], []
        for index, offer in enumerate(offers):
            kind_spec = specs.get(offer.kind)
            if offer.channel is not None:
                wanted = offer.channel.name
            elif offer.partition is not None:
                wanted = offer.partition.name
            else:
                wanted = device_names(offer.device, self.generate.strategies)[0]
            found = [d for d in (kind_spec.devices if kind_spec else ()) if d.name == wanted]
            if not found:
                raise PrepareError(f"{offer.pool}/{offer.name}: the spec pipeline builds no device for it")
            own = found[0].edits
            if extra and offer.found is not None and offer.partition is None and offer.device.address in extra:
                own = own.merge(extra[offer.device.address])  # its MPS daemon's directories and the limits
            devices.append(Device(f"{uid}-{labels[index] if labels else offer.name}", own))
            edits.append(found[0].edits)
        return versioned(Spec(kind=self.kind, devices=tuple(devices), edits=common), self.generate), edits

    def _metadata_files(self, claim: Mapping[str, object], ref: ClaimRef, results: list[tuple[str, str, str]],
                        offers: list[Offer]) -> tuple[MetadataFile, ...]:
        """Each request's device metadata file, when the driver writes them (a subrequest's devices under
        its request's name, as containers name it)."""
        if self.metadata is None:
            return ()
        requests: dict[str, list[MetadataDevice]] = {}
        for (request, _, _), offer in zip(results, offers, strict=True):
            requests.setdefault(request.partition("/")[0], []).append(
                (self.driver, offer.pool, offer.name, dict(offer.attributes)))
        return self.metadata.planned(claim, ref.namespace, ref.name, ref.uid, requests)

    # --- contests ---------------------------------------------------------------------------------------
    def contested(self) -> dict[str, Contest]:
        """The claims refused on a held device, by uid (a copy)."""
        with self.lock:
            return dict(self.contests)

    def drop_contests(self, uids: list[str]) -> None:
        """Forget claims the API server no longer allocates on the devices they were refused on."""
        with self.lock:
            for uid in uids:
                self._drop_contest(uid)

    def _drop_contest(self, uid: str) -> None:
        if self.contests.pop(uid, None) is not None:
            self.contests_changed.set()

    # --- unprepare --------------------------------------------------------------------------------------
    def unprepare(self, uid: str) -> None:
        """The claim's files, MPS daemon and booking gone, and its checkpoint entry last: a failure at any step
        leaves it checkpointed, and the kubelet's retry (every step idempotent) finishes it."""
        with self.lock:
            path = self.spec_path(uid)
            self._drop_contest(uid)
            claims = self.checkpoint.load()
            record = claims.get(uid)
            self._remove_files(path, uid)
            for gpu in record.mps or {} if record is not None else {}:
                try:
                    self.mps.release(gpu, uid)  # the claim's own daemon stops
                except MpsError as err:
                    raise PrepareError(f"claim {uid}: {err.message}") from None
            try:
                self._unbook(uid)  # the pod's containers are gone: the release finished now
            except LedgerError as err:
                raise PrepareError(f"claim {uid}: {err.message}") from None
            if record is not None:
                self.checkpoint.save({other: r for other, r in claims.items() if other != uid})
                log.info("unprepared claim %s (%s)", record.label, uid)

    def _remove_files(self, path: str, uid: str) -> None:
        """A claim's files gone: its spec, and its device metadata."""
        _remove(path)
        if self.metadata is not None:
            self.metadata.remove(uid)

    def rebook(self) -> int:
        """Book every checkpointed claim in the ledger again (a no-op for those it holds): after a restart, or
        a ledger rebuilt from live evidence (which sees no claim, but sees its pod's running containers, each
        with its pod), the hook and the device plugin still find the claims' devices taken. A claim refused
        is read again from the API server once (a checkpoint from before pods were recorded, or a pod that
        joined a shared claim) and booked with the pods it is reserved for now. The number of claims whose
        booking was refused (logged)."""
        # three steps, the API server asked in the middle with no lock held (prepares go on meanwhile)
        ask = self._rebook_checkpointed()
        if not ask:
            return 0
        answers = {uid: self._reserved_pods(uid, record) for uid, (record, _) in ask.items()}
        return self._rebook_asked(ask, answers)

    def _rebook_checkpointed(self) -> dict[str, tuple[ClaimRecord, LedgerError | None]]:
        """Each checkpointed claim booked again; those to ask the API server about (checkpointed before
        claims recorded their pods, or refused: with the refusal)."""
        ask: dict[str, tuple[ClaimRecord, LedgerError | None]] = {}
        with self.lock:
            for uid, record in self.checkpoint.load().items():
                booked = _booked(record)
                if not booked:
                    continue
                if record.pods is None:  # checkpointed before claims recorded their pods: asked first
                    ask[uid] = (record, None)
                    continue
                try:
                    self.ledger.book(self.booking(uid), NODE_PID, booked, for_pods=record.pods,
                                     consumes=record.consumes_json())
                except LedgerError as err:
                    ask[uid] = (record, err)
            self._mps_round(self.checkpoint.load())  # every round: the daemons follow the checkpoint
        return ask

    def _rebook_asked(self, ask: dict[str, tuple[ClaimRecord, LedgerError | None]],
                      answers: dict[str, tuple[str, ...] | None]) -> int:
        """The claims asked about booked with the pods the API server says they are reserved for now (what
        it said recorded); the number refused."""
        refused = 0
        with self.lock:
            claims = self.checkpoint.load()
            changed = False
            for uid, (asked, first) in ask.items():
                record, now = claims.get(uid), answers[uid]
                if record is None or record.ledger != asked.ledger:
                    continue  # unprepared (or prepared anew) meanwhile
                if first is None and now is not None:  # a checkpoint without pods learns them, booked or not
                    claims[uid] = record = record._replace(pods=now)
                    changed = True
                try:
                    self.ledger.book(self.booking(uid), NODE_PID, _booked(record),
                                     for_pods=_pods_to_book(record, first, now), consumes=record.consumes_json())
                except LedgerError as err:
                    refused += 1
                    log.warning("claim %s (%s): its devices are not in the ledger: %s", record.label, uid,
                                err.message)
                    continue
                if first is not None:
                    claims[uid], changed = record._replace(pods=now or ()), True
            if changed:
                try:
                    self.checkpoint.save(claims)
                except CheckpointError as err:  # booked; what it learned of its pods is kept another round
                    log.warning("%s", err.message)
            return refused

    def _mps_round(self, claims: Mapping[str, ClaimRecord]) -> None:
        """MPS daemons follow the checkpoint: one serving no prepared claim (a crash between the steps) stops,
        one that died while a claim needs it starts again."""
        try:
            for uid, record in claims.items():  # a claim's daemon serves it (again, after a broken record)
                for gpu, visible in (record.mps or {}).items():
                    if uid not in self.mps.recorded().get(gpu, []):
                        self.mps.acquire(gpu, uid, visible)
            for gpu, holders in self.mps.recorded().items():
                for holder in holders or [""]:  # a daemon no claim needs: stopped (not the device plugin's)
                    if holder not in claims and not holder.startswith(PLUGIN_PREFIX):
                        self.mps.release(gpu, holder)
            self.mps.check()
        except MpsError as err:
            log.warning("MPS: %s", err.message)

    def _reserved_pods(self, uid: str, record: ClaimRecord) -> tuple[str, ...] | None:
        """The pods the claim is reserved for now, by the API server; None when it cannot say (logged)."""
        namespace, name = str(record.namespace), str(record.name)
        try:
            claim = self.get_claim(namespace, name)
        except DevinjectError as err:
            log.warning("claim %s/%s (%s): cannot read it again: %s", namespace, name, uid, err.message)
            return None
        meta = claim.get("metadata")
        if not isinstance(meta, dict) or meta.get("uid") != uid:
            return None
        return tuple(sorted(set(reserved_pods(claim)) | set(self._group_members(claim, namespace, name))))

    def _group_members(self, claim: Mapping[str, object], namespace: str, name: str) -> tuple[str, ...]:
        """The pods on this node of the PodGroups the claim is reserved for: booked like the pods it names,
        so their containers share its devices. A list that fails is logged: the claim is booked for the pods
        it names, and asked again when a booking is refused."""
        read = self.group_pods
        if read is None:
            return ()
        members: set[str] = set()
        for group in reserved_groups(claim):
            try:
                members.update(read(namespace, group))
            except DevinjectError as err:
                log.warning("claim %s/%s: cannot list the pods of its PodGroup %s: %s", namespace, name, group,
                            err.message)
        return tuple(sorted(members))

    def prepared(self) -> dict[str, ClaimRecord]:
        with self.lock:
            return self.checkpoint.load()

    def clean_orphans(self) -> list[str]:
        """At start: claim specs of this driver the checkpoint does not name (a crash mid-prepare) are
        removed, and their bookings released. A corrupt checkpoint removes nothing (CheckpointError)."""
        with self.lock:
            claims = self.checkpoint.load()
            prefix = f"{self.driver}-"
            removed = []
            try:
                names = sorted(os.listdir(self.cdi_dir))
            except FileNotFoundError:
                return []
            for filename in names:
                if not (filename.startswith(prefix) and filename.endswith(".json")):
                    continue
                uid = filename[len(prefix):-len(".json")]
                if uid not in claims and valid_uid(uid) and self._ours(os.path.join(self.cdi_dir, filename)):
                    _remove(os.path.join(self.cdi_dir, filename))
                    try:
                        self.ledger.release(self.booking(uid))
                    except LedgerError as err:
                        log.warning("claim %s: %s", uid, err.message)
                    removed.append(uid)
            if self.metadata is not None:
                removed += [uid for uid in self.metadata.orphans(claims) if uid not in removed]
            if removed:
                log.info("removed %d claim spec(s) no checkpoint names: %s", len(removed), ", ".join(removed))
            return removed


    def _ours(self, path: str) -> bool:
        """Whether `path` is a claim spec this driver wrote: a regular file (never a link followed) whose kind
        is this driver's. Another driver whose name starts with this one's (`dra.devinject.io-mig`) writes
        `<its name>-<uid>.json` too, and its claims are not this driver's to remove."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            data = jsonlite.loads(os.read(fd, MAX_CLAIM_SPEC).decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return False
        finally:
            os.close(fd)
        return isinstance(data, dict) and data.get("kind") == self.kind


MAX_CLAIM_SPEC = 16 * 1024 * 1024
_UID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_NAME_CHARS = _UID_CHARS | {"."}


def valid_uid(uid: str) -> bool:
    """A claim UID as the API server makes them (a UUID) or any DNS label: lowercase letters, digits and
    `-`, at most 63, starting and ending alphanumeric: never a `/` or `..` to walk out of the CDI dir with."""
    return (0 < len(uid) <= 63 and set(uid) <= _UID_CHARS and uid[0] != "-" and uid[-1] != "-")


def checked_uid(uid: str) -> str:
    if not valid_uid(uid):
        raise PrepareError(f"claim uid {uid[:80]!r} is not a Kubernetes UID; refused")
    return uid


def _checked_name(namespace: str, name: str) -> None:
    """A namespace (DNS label) and a claim name (DNS subdomain) the kubelet could have sent: anything else
    would be put in the API server's URL."""
    if not (0 < len(namespace) <= 63 and set(namespace) <= _UID_CHARS):
        raise PrepareError(f"claim namespace {namespace[:80]!r} is not a namespace name; refused")
    if not (0 < len(name) <= 253 and set(name) <= _NAME_CHARS and ".." not in name and name[0] not in ".-"):
        raise PrepareError(f"claim name {name[:80]!r} is not a resource name; refused")


def _same_sharing(what: str, claims: Mapping[str, ClaimRecord], offers: list[Offer],
                  shares: list[tuple[str | None, Mapping[str, object]]], mps_gpus: set[str]) -> None:
    """A GPU shared by consumable capacity holds MPS clients only or none: a share that is an MPS client and
    one that is not would meet on it (the one outside MPS would reach the GPU beside the daemon's clients).
    Checked against the shares the checkpoint holds. PrepareError naming the other claim."""
    for offer, (share, _) in zip(offers, shares, strict=True):
        if share is None or offer.found is None:
            continue
        gpu = offer.device.address
        for other in claims.values():
            if not any(d.device == offer.name and d.share for d in other.devices):
                continue
            theirs = gpu in (other.mps or {})
            if theirs != (gpu in mps_gpus):
                raise PrepareError(f"{what}: {offer.name} is shared with claim {other.label}, "
                                   f"{'an MPS client' if theirs else 'not an MPS client'}: its shares are all MPS "
                                   "clients or none")


def _pods_to_book(record: ClaimRecord, refused: LedgerError | None, now: tuple[str, ...] | None) -> tuple[str, ...]:
    """The pods to book a checkpointed claim again for, after the API server was asked (`now`: the pods it
    is reserved for now; None when it could not say): those it recorded, unless its booking was `refused`
    and it is reserved for pods it did not record, which are then its pods. The refusal raised again when
    nothing new was learned."""
    if refused is None:
        return record.pods or ()
    if now is None or set(now) <= set(record.pods or ()):
        raise refused
    return now


def _booked(record: ClaimRecord) -> tuple[Claim, ...]:
    return tuple(Claim(b.name, tuple(map(NodeId, b.nodes)), tuple(map(NodeId, b.shared))) for b in record.bookings)


def _remove(path: str) -> None:
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass
    except OSError as err:
        raise PrepareError(f"{path}: cannot remove the claim's CDI spec: {err.strerror}") from None
