"""nodestate/pluginrelease.py: when a device-plugin booking ends (one rule for the device plugin and the DRA
driver), and the DRA driver's releaser over a real ledger and pod directories: a booking whose pod the
kubelet no longer has is released whether or not the device plugin runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

from devinject.nodestate.ledger import Claim, Ledger, LedgerEntry
from devinject.nodestate.pluginrelease import GonePodReleaser, plugin_verdicts

POD_A = "6f1c2d3e-0000-4000-8000-00000000000a"
POD_B = "6f1c2d3e-0000-4000-8000-00000000000b"
GPU = "nvidia.com/gpu"


def booking(pods: list[str], at: float) -> LedgerEntry:
    return LedgerEntry((f"{GPU}=0",), ("c 195:0",), (), 1, 0, time=at, plugin=GPU, pods=tuple(pods))


def test_the_rule_for_each_booking() -> None:
    now = 1000.0
    allocations = {
        f"device-plugin:{GPU}:0000:18:00.0": booking([POD_A], now - 500),  # its pod gone
        f"device-plugin:{GPU}:0000:2a:00.0": booking([POD_B], now - 500),  # its pod there
        f"device-plugin:{GPU}:0000:3a:00.0": booking([], now - 31),  # no pod took it within the grace
        f"device-plugin:{GPU}:0000:5d:00.0": booking([], now - 5),  # no pod yet, within the grace
        "container-1": LedgerEntry((f"{GPU}=1",), ("c 195:1",), (), 42, 0),  # the hook's: not ours
    }
    learned, released = plugin_verdicts(allocations, None, {POD_B}, now)  # the DRA driver's view: no checkpoint
    assert learned == {}
    assert sorted(released) == [f"device-plugin:{GPU}:0000:18:00.0", f"device-plugin:{GPU}:0000:3a:00.0"]
    # the device plugin's: the checkpoint names the pod that took the youngest one
    learned, released = plugin_verdicts(allocations, {(GPU, "0000:5d:00.0"): {POD_B}}, {POD_B}, now)
    assert learned == {f"device-plugin:{GPU}:0000:5d:00.0": [POD_B]}
    assert sorted(released) == [f"device-plugin:{GPU}:0000:18:00.0", f"device-plugin:{GPU}:0000:3a:00.0"]
    # pod directories that cannot be read: only the checkpoint forgetting a pod ends its booking
    assert plugin_verdicts(allocations, None, None, now)[1] == [f"device-plugin:{GPU}:0000:3a:00.0"]


def make_state(tmp_path: Path) -> tuple[Path, Path, Ledger]:
    state, pods = tmp_path / "state", tmp_path / "pods"
    state.mkdir(mode=0o755)
    pods.mkdir()
    ledger = Ledger(str(state))
    ledger.book_plugin(GPU, {"0000:18:00.0": Claim(f"{GPU}=0", ("c 195:0",))}, pods={"0000:18:00.0": [POD_A]},
                       policy={})
    ledger.book_plugin(GPU, {"0000:2a:00.0": Claim(f"{GPU}=1", ("c 195:1",))}, pods={"0000:2a:00.0": [POD_B]},
                       policy={})
    return state, pods, ledger


def plugin_bookings(state: Path) -> list[str]:
    allocations = json.loads((state / "ledger.json").read_text())["allocations"]
    return sorted(cid for cid in allocations if cid.startswith("device-plugin:"))


def test_the_releaser_ends_the_bookings_of_pods_the_kubelet_no_longer_has(tmp_path: Path) -> None:
    state, pods, _ = make_state(tmp_path)
    (pods / POD_B).mkdir()
    releaser = GonePodReleaser(str(state), str(pods))
    assert releaser.release() == [f"device-plugin:{GPU}:0000:18:00.0"]  # POD_A has no directory
    assert plugin_bookings(state) == [f"device-plugin:{GPU}:0000:2a:00.0"]
    assert releaser.release() == []  # nothing changed
    (pods / POD_B).rmdir()  # the kubelet is done with it: seen at the next look, not after `every`
    assert releaser.release() == [f"device-plugin:{GPU}:0000:2a:00.0"]
    assert plugin_bookings(state) == []
    events = [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]
    assert [e["container"] for e in events if e.get("event") == "released"] == [
        f"device-plugin:{GPU}:0000:18:00.0", f"device-plugin:{GPU}:0000:2a:00.0"]


def test_without_the_pod_directories_nothing_is_released(tmp_path: Path) -> None:
    state, pods, _ = make_state(tmp_path)
    pods.rmdir()
    assert GonePodReleaser(str(state), str(pods)).release() == []
    assert len(plugin_bookings(state)) == 2


def test_a_booking_no_pod_took_ends_after_the_grace_at_the_next_look(tmp_path: Path) -> None:
    state, pods, ledger = make_state(tmp_path)
    (pods / POD_A).mkdir()
    (pods / POD_B).mkdir()
    ledger.book_plugin(GPU, {"0000:3a:00.0": Claim(f"{GPU}=2", ("c 195:2",))}, policy={})
    releaser = GonePodReleaser(str(state), str(pods), grace=30.0, every=10.0)
    assert releaser.release() == []
    assert releaser.release(time.time() + 5) == []  # nothing changed, not yet due
    assert releaser.release(time.time() + 31) == [f"device-plugin:{GPU}:0000:3a:00.0"]
