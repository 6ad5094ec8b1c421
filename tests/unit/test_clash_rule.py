"""nodestate/clashrule.py: the ledger's clash rule, row by row, and the booking plans built on it (pure: no
file, lock or process)."""

from __future__ import annotations

import pytest

from devinject.core.errors import LedgerError
from devinject.nodestate.clashrule import clash, plan_booking, plan_plugin_booking
from devinject.nodestate.ledger import LedgerEntry

N, M = "c 195:0", "c 195:1"  # a device's node; another's
PARENT = "c 195:255"  # a MIG device's parent GPU, shared by the claims and containers of its MIG devices


def container(exclusive: tuple[str, ...] = (), shared: tuple[str, ...] = (), *, pid: int = 10,
              pod: str | None = None, recovered: bool = False, state: str = "active") -> LedgerEntry:
    return LedgerEntry(("vendor.com/gpu=0",), exclusive, shared, pid, 100, state, pod=pod, recovered=recovered)


def claim(exclusive: tuple[str, ...] = (), shared: tuple[str, ...] = (), *, pods: tuple[str, ...] = ("pod-a",),
          consumes: dict[str, dict[str, list[int]]] | None = None) -> LedgerEntry:
    return LedgerEntry(("vendor.com/gpu=0",), exclusive, shared, 1, 100, pods=pods, consumes=consumes)


def plugin(exclusive: tuple[str, ...] = (), shared: tuple[str, ...] = (), *, pods: tuple[str, ...] = ()) -> LedgerEntry:
    return LedgerEntry(("vendor.com/gpu=0",), exclusive, shared, 1, 100, plugin="vendor.com/gpu", pods=pods)


SHARE = {N: {"memory": [10, 80]}}
HELD = (N, "held")

ROWS = [
    # (why, mine, other, shared_kind, our_claims, expected)
    ("exclusive against exclusive", container((N,)), container((N,), pid=11), (), (), HELD),
    ("exclusive against shared", container((N,)), container(shared=(N,), pid=11), (), (), HELD),
    ("shared against exclusive", container(shared=(N,)), container((N,), pid=11), (), (), HELD),
    ("shared beside shared", container(shared=(N,)), container(shared=(N,), pid=11), (), (), None),
    ("other devices", container((N,)), container((M,), pid=11), (), (), None),
    ("the first clashing node is named", container((M, N)), container((M, N), pid=11), (), (), (N, "held")),
    ("evidence of this very process", container((N,)), container((N,), recovered=True), (), (), None),
    ("evidence of another process", container((N,)), container((N,), pid=11, recovered=True), (), (), HELD),
    ("evidence on a kind that shares every device", container(shared=(N,)),
     container((N,), pid=11, recovered=True), (N,), (), None),
    ("a shared kind against a live exclusive booking", container(shared=(N,)), container((N,), pid=11), (N,), (),
     HELD),
    ("a claim and a container of its pod", claim((N,)), container((N,), pod="pod-a"), (), (), None),
    ("a container and a claim of its pod", container((N,), pod="pod-a"), claim((N,)), (), (), None),
    ("a container and a claim of another pod", container((N,), pod="pod-b"), claim((N,)), (), (), HELD),
    ("a container in no pod and a claim", container((N,)), claim((N,)), (), (), HELD),
    ("a container and the device plugin's booking", container((N,)), plugin((N,)), (), (), None),
    ("a claim and the device plugin's booking", claim((N,)), plugin((N,)), (), (), HELD),
    ("the device plugin and a container", plugin((N,)), container((N,)), (), (), None),
    ("the device plugin and a claim", plugin((N,)), claim((N,)), (), (), HELD),
    ("the device plugin and its own booking of the device", plugin((N,)), plugin((N,), pods=("pod-c",)), (), (),
     HELD),
    ("the device plugin and a recovered holding", plugin((N,)), container((N,), recovered=True), (), (), None),
    ("two containers of a claim's pods, on its device", container((N,), pod="pod-a"),
     container((N,), pid=11, pod="pod-b"), (), (claim((N,), pods=("pod-a", "pod-b")),), None),
    ("two containers of a claim's pods, on the parent it shares", container((PARENT,), pod="pod-a"),
     container((PARENT,), pid=11, pod="pod-b"), (), (claim(shared=(PARENT,), pods=("pod-a", "pod-b")),),
     (PARENT, "held")),
    ("a container of a claim's pod and one of another pod", container((N,), pod="pod-a"),
     container((N,), pid=11, pod="pod-b"), (), (claim((N,), pods=("pod-a",)),), HELD),
    ("a capacity share beside another share", claim(shared=(N,), consumes=SHARE),
     claim(shared=(N,), pods=("pod-b",), consumes=SHARE), (), (), None),
    ("a capacity share against a booking outside capacity", claim(shared=(N,), consumes=SHARE),
     container(shared=(N,)), (), (), (N, "held outside consumable capacity")),
    ("a booking outside capacity against a share", container(shared=(N,)), claim(shared=(N,), consumes=SHARE),
     (), (), (N, "shared by consumable capacity")),
    ("a container riding its pod's share, beside another pod's share", container(shared=(N,), pod="pod-a"),
     claim(shared=(N,), pods=("pod-b",), consumes=SHARE), (), (claim(shared=(N,), consumes=SHARE),), None),
    ("a container riding its pod's share, as it asked it", container((N,), pod="pod-a"),
     claim(shared=(N,), pods=("pod-b",), consumes=SHARE), (), (claim(shared=(N,), consumes=SHARE),), None),
    ("a capacity share and evidence of a container on it", claim(shared=(N,), consumes=SHARE),
     container((N,), pid=11, recovered=True), (N,), (), None),
]


@pytest.mark.parametrize(("mine", "other", "shared_kind", "our_claims", "expected"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_the_clash_rule(mine: LedgerEntry, other: LedgerEntry, shared_kind: tuple[str, ...],
                        our_claims: tuple[LedgerEntry, ...], expected: tuple[str, str] | None) -> None:
    assert clash(mine, other, shared_kind=frozenset(shared_kind), our_claims=our_claims) == expected


# --- the plans ------------------------------------------------------------------------------------------------
def test_the_same_process_booking_again_only_learns_its_pod() -> None:
    before = {"c1": container((N,))}
    planned, new = plan_booking(before, "c1", container((N,), pod="pod-a"))
    assert not new and planned == {"c1": container((N,), pod="pod-a")}
    assert before == {"c1": container((N,))}, "the plan changed what it was given"


def test_an_id_booked_for_another_live_process_is_refused() -> None:
    with pytest.raises(LedgerError, match="^container c1: the id is booked for another live process .pid 10."):
        plan_booking({"c1": container((N,))}, "c1", container((M,), pid=11))


def test_a_dead_containers_id_is_reused_and_its_booking_kept_until_its_nodes_are_free() -> None:
    dead = container((N,), state="reclaiming")
    planned, new = plan_booking({"c1": dead}, "c1", container((M,), pid=11))
    assert new and planned == {"c1@100": dead, "c1": container((M,), pid=11)}
    with pytest.raises(LedgerError, match="device c 195:0 is held by container c1@100 .reclaiming, pid 10."):
        plan_booking({"c1": dead}, "c1", container((N,), pid=11))


def test_a_clash_names_the_holder() -> None:
    with pytest.raises(LedgerError, match="^vendor.com/gpu=0: device c 195:0 is held by the device plugin: "
                                          "vendor.com/gpu device 0000:18:00.0, pod not known yet$"):
        plan_booking({"device-plugin:vendor.com/gpu:0000:18:00.0": plugin((N,))}, "claim", claim((N,)))


def test_time_sliced_devices_have_as_many_containers_as_replicas() -> None:
    held = {"c1": container(shared=(N,)), "c2": container(shared=(N,), pid=11)}
    sliced = {"vendor.com/gpu=0": (2, N)}
    with pytest.raises(LedgerError, match=r"^vendor.com/gpu=0: time-sliced 2 ways and held by 2 containers already "
                                          r"\(c1, c2\)$"):
        plan_booking(held, "c3", container(shared=(N,), pid=12), time_sliced=sliced)
    assert plan_booking(held, "c3", container(shared=(N,), pid=12), time_sliced={"vendor.com/gpu=0": (3, N)})[1]
    held["c2"] = container(shared=(N,), pid=11, state="reclaiming")
    assert plan_booking(held, "c3", container(shared=(N,), pid=12), time_sliced=sliced)[1]


def test_capacity_shares_never_sum_beyond_the_devices_total() -> None:
    held = {"a": claim(shared=(N,), consumes={N: {"memory": [50, 80]}})}
    with pytest.raises(LedgerError, match=r"^vendor.com/gpu=0: device c 195:0: memory 40 asked, 30 of 80 left "
                                          r"\(held by a\)$"):
        plan_booking(held, "b", claim(shared=(N,), pods=("pod-b",), consumes={N: {"memory": [40, 80]}}))
    assert plan_booking(held, "b", claim(shared=(N,), pods=("pod-b",), consumes={N: {"memory": [30, 80]}}))[1]


def test_a_container_rides_its_pods_capacity_share_shared() -> None:
    share = claim(shared=(N,), consumes=SHARE)
    other = claim(shared=(N,), pods=("pod-b",), consumes=SHARE)
    planned, _ = plan_booking({"claim-a": share, "claim-b": other}, "c1", container((N, M), pod="pod-a"))
    assert planned["c1"].exclusive == (M,) and planned["c1"].shared == (N,)


def test_the_device_plugin_books_all_or_none() -> None:
    held = {"claim": claim((M,))}
    wanted = {"device-plugin:vendor.com/gpu:a": plugin((N,)), "device-plugin:vendor.com/gpu:b": plugin((M,))}
    with pytest.raises(LedgerError, match=r"^vendor.com/gpu=0 \(vendor.com/gpu device b\): device c 195:1 is held "
                                          r"by container claim"):
        plan_plugin_booking(held, wanted)
    planned, booked = plan_plugin_booking({}, wanted)
    assert booked == list(wanted) and planned == wanted


def test_the_device_plugins_own_booking_is_replaced_or_learns_its_pods() -> None:
    booking_id = "device-plugin:vendor.com/gpu:a"
    held = {booking_id: plugin((N,), pods=("pod-a",))}
    planned, booked = plan_plugin_booking(held, {booking_id: plugin((N,))})
    assert booked == [booking_id] and planned[booking_id].pods == ()
    planned, booked = plan_plugin_booking(held, {booking_id: plugin((N,))}, {booking_id: ("pod-b",)})
    assert booked == [] and planned[booking_id].pods == ("pod-a", "pod-b")


def test_the_device_plugins_refusal_names_the_first_node_either_rule_refuses() -> None:
    """The plugin's Allocate of a MIG-like device (M its own, N shared with its siblings) meets a claim holding M
    exclusively and N as a consumable-capacity share: both nodes are refused (M held, N shared by consumable
    capacity outside the plugin's accounting), and the message names the first of them, N, as the ledger
    before the clash rule's split did (the split named the plain clash, M, first)."""
    held = {"claim": claim((M,), (N,), consumes=SHARE)}
    with pytest.raises(LedgerError, match=r"\): device c 195:0 is held by container claim"):
        plan_plugin_booking(held, {"device-plugin:vendor.com/gpu:a": plugin((M,), (N,))})
