"""ledger.json's records (nodestate/ledger.py: LedgerEntry, LedgerFile) against golden files: the bookings of
every kind (a container's with its pod, a claim's with consumable-capacity shares, a claim without, the
device plugin's with a shared node, a released container's, one recovered from evidence by a rebuild), as
the ledger wrote them before it had records (tests/fixtures/ledger/, made by `scenario` below on commit
4375c03, whose nodestate/ledger.py is v0.1.0's). Parsed and written back they give the same bytes, and the
same operations on this tree write the same files: another devinject (an older agent, a newer hook) reads
them as it always did."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from devinject.core import jsonlite
from devinject.nodestate import evidence, podcgroup
from devinject.nodestate import ledger as ledger_module
from devinject.nodestate.ledger import Claim, Ledger, LedgerEntry, LedgerFile, allocations_json

GOLDEN = Path(__file__).parents[1] / "fixtures" / "ledger"
NOW = 1_700_000_000.25
POLICY = {"nvidia.com/gpu": "exclusive", "nvidia.com/mig": "exclusive"}
FILES = ("booked/ledger.json", "booked/ledger-claims.json", "rebuilt/ledger.json", "rebuilt/ledger-claims.json")


def scenario(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind of booking, through the ledger's public operations only, with the clock, the processes, their
    pods and pid namespaces fixed: `booked/` after them, `rebuilt/` after a corrupt ledger was rebuilt from
    evidence and its claims' copy and one more container booked."""
    clock = types.SimpleNamespace(time=lambda: NOW, time_ns=lambda: int(NOW * 1e9))
    monkeypatch.setattr(ledger_module, "time", clock)
    monkeypatch.setattr(ledger_module, "process_start_time", lambda pid, proc="/proc": 1000 + pid)
    monkeypatch.setattr(ledger_module, "has_own_pid_namespace", lambda pid, proc="/proc": pid == 4242)
    monkeypatch.setattr(ledger_module.Ledger, "pid_namespace", lambda self: "4:4026531836")
    monkeypatch.setattr(podcgroup, "pod_of", lambda pid, proc="/proc": "pod-a" if pid == 4242 else None)
    monkeypatch.setattr(evidence, "collect", lambda proc="/proc": [evidence.Holding("cgroup 5151", 5151, ("c 195:6",),
                                                                                     "pod-d")])
    booked, rebuilt = state / "booked", state / "rebuilt"
    booked.mkdir(mode=0o700)
    ledger = Ledger(str(booked))
    ledger.book("c1", 4242, (Claim("nvidia.com/gpu=0", ("c 195:0",)),), POLICY)  # type: ignore[arg-type]
    ledger.book("dra-claim:dra.devinject.io:uid-1", 1, (Claim("nvidia.com/gpu=1", ("c 195:1",)),),  # type: ignore[arg-type]
                POLICY, for_pods=("pod-b", "pod-b2"), consumes={"c 195:1": {"memory": [10, 80], "cores": [1, 4]}})
    ledger.book("dra-claim:dra.devinject.io:uid-2", 1, (Claim("nvidia.com/mig=2:0", ("c 195:2", "c 508:3"),  # type: ignore[arg-type]
                                                               ("c 195:2",)),), POLICY, for_pods=("pod-a",))
    ledger.book_plugin("nvidia.com/gpu", {"0000:5d:00.0": Claim("nvidia.com/gpu=3", ("c 195:3", "c 195:255"),  # type: ignore[arg-type]
                                                                ("c 195:255",))}, policy=POLICY)
    ledger.plugin_update({"device-plugin:nvidia.com/gpu:0000:5d:00.0": ["pod-c"]})
    ledger.book("c2", 4343, (Claim("nvidia.com/gpu=4", ("c 195:4",)),), POLICY)  # type: ignore[arg-type]
    assert ledger.release("c2") == "released"
    rebuilt.mkdir(mode=0o700)
    for name in ("ledger.json", "ledger-claims.json"):
        (rebuilt / name).write_bytes((booked / name).read_bytes())
    (rebuilt / "ledger.json").write_text("{broken")
    Ledger(str(rebuilt)).book("c3", 4444, (Claim("nvidia.com/gpu=5", ("c 195:5",)),), POLICY)  # type: ignore[arg-type]


def test_this_tree_writes_the_golden_ledgers_byte_for_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario(tmp_path, monkeypatch)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (GOLDEN / name).read_bytes(), name


@pytest.mark.parametrize("name", [name for name in FILES if name.endswith("/ledger.json")])
def test_a_golden_ledger_parses_into_records_that_write_it_back_exactly(name: str) -> None:
    raw = (GOLDEN / name).read_bytes()
    parsed = LedgerFile.from_json(jsonlite.loads(raw))
    assert jsonlite.dumps(parsed.to_json(), sort_keys=True).encode() == raw
    assert all(isinstance(entry, LedgerEntry) for entry in parsed.allocations.values())
    assert len(parsed.allocations) >= 5 and parsed.pid_namespace == "4:4026531836"


@pytest.mark.parametrize("name", [name for name in FILES if name.endswith("/ledger-claims.json")])
def test_the_claims_copy_parses_and_writes_back_exactly(name: str) -> None:
    raw = (GOLDEN / name).read_bytes()
    parsed = {cid: LedgerEntry.from_json(entry) for cid, entry in jsonlite.loads(raw).items()}
    assert jsonlite.dumps(allocations_json(parsed), sort_keys=True).encode() == raw


def test_every_field_of_a_booking_is_in_its_record() -> None:
    """The golden files hold every field the ledger writes; each one is a field of the record, with its value
    (`consumes` was written by `book` and missing from the record readers had)."""
    data = json.loads((GOLDEN / "booked/ledger.json").read_text())
    claim = LedgerEntry.from_json(data["allocations"]["dra-claim:dra.devinject.io:uid-1"])
    assert claim.consumes == {"c 195:1": {"cores": [1, 4], "memory": [10, 80]}} and claim.pods == ("pod-b", "pod-b2")
    assert claim.exclusive == () and claim.shared == ("c 195:1",) and claim.pid == 1
    plugin = LedgerEntry.from_json(data["allocations"]["device-plugin:nvidia.com/gpu:0000:5d:00.0"])
    assert plugin.plugin == "nvidia.com/gpu" and plugin.pods == ("pod-c",) and plugin.shared == ("c 195:255",)
    released = LedgerEntry.from_json(data["allocations"]["c2"])
    assert released.state == "reclaiming" and released.released_at == NOW
    container = LedgerEntry.from_json(data["allocations"]["c1"])
    assert container.pod == "pod-a" and container.own_pid_ns and container.pods is None and container.consumes is None
    recovered = LedgerEntry.from_json(json.loads((GOLDEN / "rebuilt/ledger.json").read_text())
                                      ["allocations"]["recovered: cgroup 5151"])
    assert recovered.recovered and recovered.pod == "pod-d" and recovered.exclusive == ("c 195:6",)
    written = {key for entry in data["allocations"].values() for key in entry} | {"recovered"}
    assert written == set(LedgerEntry._fields)


def test_numbers_keep_their_json_type() -> None:
    """A time written as a whole number (by hand, or another writer) is written back as one."""
    entry = {"devices": [], "exclusive": ["c 195:0"], "shared": [], "pid": 7, "start_time": 9, "state": "active",
             "time": 1700000000, "own_pid_ns": False}
    assert jsonlite.dumps(LedgerEntry.from_json(entry).to_json(), sort_keys=True) == \
        jsonlite.dumps(entry, sort_keys=True)
