"""The ledger's clash rule and booking plans: pure functions of the bookings (nodestate/ledger.py's records),
no file, lock or process read. ledger.py gathers the facts (the pid's start time and pod, the sharing
policy, the time-sliced kinds), loads the bookings under its lock, plans here and writes what the plan says.

Two bookings clash on a device node when one holds it exclusively and the other holds it at all; a node
both hold shared is no clash. The exceptions, each a row of tests/unit/test_clash_rule.py:
- a DRA claim's booking and a container of a pod the claim is reserved for (`same_pod`), either way round;
- two containers of a claim's pods, on the nodes the claim holds exclusively for them;
- a container and the device plugin's booking (the kubelet keeps its own pods apart); the device plugin
  meets only bookings held for pods (claims', its own), never a container's;
- evidence of the booking's own process from an earlier run of its hook (`recovered`, the same pid), and a
  recovered holding on a node of a kind that shares every device (evidence names nodes, not their sharing);
- a consumable-capacity share (DRAConsumableCapacity) meets only other shares of its device, either way
  round; a container riding its pod's claim's share stands beside the other shares of that device; and the
  shares of a node never sum beyond its capacity (`capacity_left`).
"""

from __future__ import annotations

from devinject.core.errors import LedgerError

TYPE_CHECKING = False  # the hook books through this module: `typing` stays off its start path
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from devinject.nodestate.ledgerrecords import Consumes, LedgerEntry


HELD = "held"  # the plain clash: the node is held by the other booking


def same_pod(booking: LedgerEntry, other: LedgerEntry) -> bool:
    """Whether one of two bookings is a claim's (`pods`: the pods it is reserved for) and the other a
    container of one of those pods (`pod`, read from its cgroup): the claim holds its devices for that pod's
    containers, so theirs is no clash, whichever was booked first."""
    return (booking.pod is not None and booking.pod in (other.pods or ())) or \
        (other.pod is not None and other.pod in (booking.pods or ()))


def claims_of_pod(booking: LedgerEntry, allocations: Iterable[LedgerEntry]) -> tuple[LedgerEntry, ...]:
    """The claims reserved for a container's pod: their devices are shared by their pods' containers."""
    if booking.pod is None:
        return ()
    return tuple(entry for entry in allocations if booking.pod in (entry.pods or ()))


def riding_nodes(our_claims: Iterable[LedgerEntry]) -> frozenset[str]:
    """The nodes a container rides on through its pod's claims' consumable-capacity shares."""
    return frozenset(node for reserved in our_claims for node in (reserved.consumes or {}))


def ride_shares(booking: LedgerEntry, our_claims: tuple[LedgerEntry, ...]) -> LedgerEntry:
    """A container of a pod whose claim holds a consumable-capacity share of a device holds that device
    shared: the share is not the container's alone, other pods' shares ride on it too."""
    riding = riding_nodes(our_claims)
    if not riding & set(booking.exclusive):
        return booking
    return booking._replace(exclusive=tuple(n for n in booking.exclusive if n not in riding),
                            shared=tuple(sorted(set(booking.shared) | (riding & set(booking.exclusive)))))


def clashes(exclusive: Iterable[str], shared: Iterable[str], held: tuple[set[str], set[str]]) -> set[str]:
    """The nodes of a holding (exclusive, shared) that clash with what others hold ((exclusive, shared)):
    exclusive against anything held, shared against what is held exclusively."""
    return set(exclusive) & (held[0] | held[1]) | set(shared) & held[0]


def capacity_clash(nodes: set[str], consumes: Consumes, entry: LedgerEntry) -> tuple[str, str] | None:
    """(node, why) when a booking of `nodes` consuming `consumes` (consumable capacity: DRAConsumableCapacity
    shares) cannot stand beside `entry`: a capacity share meets only other capacity shares of its device,
    never a booking that holds the node otherwise (exclusive, a time-sliced container, a device-plugin
    replica), either way round; and the shares of a node never sum beyond its capacity (capacity_left)."""
    theirs = entry.consumes or {}
    for node in sorted(nodes & (set(entry.exclusive) | set(entry.shared))):
        if (node in consumes) != (node in theirs):
            return node, ("shared by consumable capacity" if node in theirs else "held outside consumable capacity")
    return None


def clash(mine: LedgerEntry, other: LedgerEntry, *, shared_kind: frozenset[str] = frozenset(),
          our_claims: tuple[LedgerEntry, ...] = ()) -> tuple[str, str] | None:
    """(node, how it is held) where booking `mine` cannot stand beside `other`, or None. `shared_kind`:
    mine's nodes of kinds that share every device; `our_claims`: the claims reserved for mine's pod
    (claims_of_pod)."""
    if other.recovered and other.pid == mine.pid:
        return None  # evidence of this very container from an earlier run of its hook
    if same_pod(mine, other):
        return None  # a claim and a container of a pod it is reserved for
    if mine.plugin is not None and other.pods is None:
        return None  # the device plugin's Allocate and a container: the kubelet's pods' own containers
    if mine.pods is None and other.plugin is not None:
        return None  # a container and the device plugin's booking: the kubelet keeps its own pods apart
    nodes = clashes(mine.exclusive, mine.shared, (set(other.exclusive), set(other.shared)))
    if other.recovered:
        nodes -= shared_kind  # evidence names nodes, not how their kind shares them
    for reserved in our_claims:  # two containers of a claim's pods, on the devices it holds for both
        if other.pod is not None and other.pod in (reserved.pods or ()):
            nodes -= set(reserved.exclusive)  # not what it shares with others (a MIG parent)
    riding = riding_nodes(our_claims)
    if other.consumes:
        nodes -= riding
    if nodes:
        return sorted(nodes)[0], HELD
    if other.recovered:
        return None
    return capacity_clash((set(mine.exclusive) | set(mine.shared)) - riding, mine.consumes or {}, other)


def capacity_left(consumes: Consumes, allocations: Mapping[str, LedgerEntry], skip: str) -> str | None:
    """Why `consumes` does not fit beside the other bookings' shares of the same nodes (None: it fits):
    the sum of every booking's amount of a capacity, this one's included, at most the device's total (the
    scheduler's view may be stale; the ledger is the node's word)."""
    for node, caps in sorted(consumes.items()):
        for name, (amount, total) in sorted(caps.items()):
            used = 0
            users = []
            for cid, entry in allocations.items():
                theirs = (entry.consumes or {}).get(node, {}).get(name)
                if cid != skip and theirs:
                    used += theirs[0]
                    users.append(cid)
            if used + amount > total:
                return (f"device {node}: {name} {amount} asked, {total - used} of {total} left (held by "
                        f"{_some(users)})")
    return None


def _some(names: list[str]) -> str:
    return f"{', '.join(sorted(names)[:4])}{', ...' if len(names) > 4 else ''}"


def time_slices_left(container_id: str, first_nodes: Mapping[str, tuple[int, str]],
                     allocations: Mapping[str, LedgerEntry]) -> str | None:
    """Why a container cannot have its time-sliced devices (None: it can): a device the device plugin
    time-slices N ways is held by at most N containers (the kubelet hands out N replicas; a container
    started outside its accounting is one too many). `first_nodes`: claim name -> (replicas, the device's
    own node, a GPU's /dev/nvidiaN)."""
    for name, (replicas, node) in first_nodes.items():
        holders = [cid for cid, entry in allocations.items()
                   if cid != container_id and entry.pods is None and entry.state == "active"
                   and (node in entry.shared or node in entry.exclusive)]
        if len(holders) >= replicas:
            return (f"{name}: time-sliced {replicas} ways and held by {len(holders)} containers already "
                    f"({_some(holders)})")
    return None


def plugin_device_id(booking_id: str) -> str:
    """The device ID of a `device-plugin:<resource>:<ID>` booking (a resource name has no colon; an ID, a PCI
    address, has)."""
    return booking_id.split(":", 2)[2] if booking_id.count(":") >= 2 else ""


def describe(booking_id: str, entry: LedgerEntry) -> str:
    """Who holds a device, for an error a person reads (the kubelet's event, the driver's log)."""
    if entry.plugin is not None:
        pods = entry.pods or ("not known yet",)
        return (f"the device plugin: {entry.plugin} device {plugin_device_id(booking_id)}, "
                f"pod {', '.join(pods)}")
    return f"container {booking_id} ({entry.state}, pid {entry.pid})"


def plan_booking(allocations: Mapping[str, LedgerEntry], container_id: str, booking: LedgerEntry, *,
                 shared_kind: frozenset[str] = frozenset(),
                 time_sliced: Mapping[str, tuple[int, str]] | None = None) -> tuple[dict[str, LedgerEntry], bool]:
    """The bookings once `booking` (a container's, or a claim's: `pods`) is made as `container_id`, and whether
    it is new (False: the same process booked again, only its pods learned). LedgerError when it clashes.
    `time_sliced`: as time_slices_left's `first_nodes`, for a container."""
    planned = dict(allocations)
    existing = planned.get(container_id)
    if existing is not None:
        if (existing.pid, existing.start_time) == (booking.pid, booking.start_time):
            planned[container_id] = _learn_pods(existing, booking)  # the hook ran again for this container
            return planned, False
        if existing.state != "reclaiming":
            raise LedgerError(f"container {container_id}: the id is booked for another live process "
                              f"(pid {existing.pid}); refusing a second container with the same id")
        # A new container reusing a dead one's id: the old booking stays until its nodes are free.
        planned[f"{container_id}@{existing.start_time}"] = planned.pop(container_id)
    names = ", ".join(booking.devices)
    sliced = time_slices_left(container_id, time_sliced or {}, planned)
    if sliced is not None:
        raise LedgerError(sliced)
    our_claims = claims_of_pod(booking, planned.values())
    booking = ride_shares(booking, our_claims)
    for other_id, other in planned.items():
        found = clash(booking, other, shared_kind=shared_kind, our_claims=our_claims)
        if found is not None:
            raise LedgerError(f"{names}: device {found[0]} is {found[1]} by {describe(other_id, other)}")
    left = capacity_left(booking.consumes or {}, planned, container_id)
    if left is not None:
        raise LedgerError(f"{names}: {left}")
    planned[container_id] = booking
    return planned, True


def _learn_pods(existing: LedgerEntry, booking: LedgerEntry) -> LedgerEntry:
    """A booking made again by its own process: a claim's consumers, or a container's pod, as now known."""
    if booking.pods is not None:
        return existing._replace(pods=booking.pods)
    if booking.pod is not None:
        return existing._replace(pod=booking.pod)
    return existing


def plan_plugin_booking(allocations: Mapping[str, LedgerEntry], wanted: Mapping[str, LedgerEntry],
                        learned: Mapping[str, tuple[str, ...]] | None = None,
                        ) -> tuple[dict[str, LedgerEntry], list[str]]:
    """The bookings once the device plugin's `wanted` (booking id -> booking) are made, all or none, and the
    ids newly booked; LedgerError naming the first that clashes. `learned` (a rebook from the kubelet's
    checkpoint: booking id -> its pods): a booking there already only learns its pods."""
    for booking_id, mine in wanted.items():
        if learned is not None and booking_id in allocations:
            continue  # known: only its pods are learned, below
        for other_id, other in allocations.items():
            if other_id in wanted:
                continue  # this request's own devices: replaced
            found = clash(mine, other)
            if found is not None:
                # named as both rules refuse together: the first node held, or shared by consumable capacity
                capacity = capacity_clash(mine.nodes, {}, other)
                node = min(found[0], capacity[0]) if capacity is not None else found[0]
                raise LedgerError(f"{mine.devices[0]} ({mine.plugin} device {plugin_device_id(booking_id)}): "
                                  f"device {node} is held by {describe(other_id, other)}")
    planned = dict(allocations)
    booked: list[str] = []
    for booking_id, mine in wanted.items():
        existing = planned.get(booking_id)
        if learned is not None and existing is not None:
            pods = set(existing.pods or ()) | set(learned.get(booking_id, ()))
            planned[booking_id] = existing._replace(pods=tuple(sorted(pods)))
            continue
        planned[booking_id] = mine
        booked.append(booking_id)
    return planned, booked
