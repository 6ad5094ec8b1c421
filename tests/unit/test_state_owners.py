"""The state dir's files each have one owner in nodestate/ (docs/lifecycle.md, "State files"): a record with a
version that reads back what it wrote, and one strict reader whose every refusal is one line naming the file
and the field: a version it does not know, a corrupt file, a truncated one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devinject.nodestate import healthverdicts
from devinject.nodestate.healthverdicts import DeviceVerdict, HealthVerdicts
from devinject.nodestate.statefile import StateFileError

KEY = "nvidia.com/gpu=0000:18:00.0"


def _verdicts() -> HealthVerdicts:
    return HealthVerdicts(("c 195:2",), {KEY: DeviceVerdict("unhealthy", "unhealthy", ("Xid 79",)),
                                         "nvidia.com/gpu=0000:3b:00.0": DeviceVerdict("healthy")}, 12.5)


# --- health.json ---------------------------------------------------------------------------------------------
def test_health_verdicts_read_back_what_was_written(tmp_path: Path) -> None:
    healthverdicts.write(str(tmp_path), _verdicts())
    assert healthverdicts.read(str(tmp_path)) == _verdicts()
    raw = json.loads((tmp_path / "health.json").read_text())
    assert raw["version"] == healthverdicts.VERSION and raw["unhealthy_nodes"] == ["c 195:2"]
    assert os.stat(tmp_path / "health.json").st_mode & 0o777 == 0o644  # every reader may read it


def test_no_health_file_is_no_verdict_and_one_before_versions_reads_as_version_1(tmp_path: Path) -> None:
    assert healthverdicts.read(str(tmp_path)) is None
    (tmp_path / "health.json").write_text(json.dumps({"unhealthy_nodes": ["c 195:0"]}))
    assert healthverdicts.read(str(tmp_path)) == HealthVerdicts(("c 195:0",), {}, 0.0, 1)


@pytest.mark.parametrize(("content", "field"), [
    ('{"version": 2, "unhealthy_nodes": []}', ".version: 2 is not a version this devinject reads (1)"),
    ('{"version": true}', ".version: True is not a version"),
    ('{"unhealthy_nodes": ["c 195', ": not JSON"),  # truncated mid-write by something else than the agent
    ("", ": not JSON"),
    ("\xff\xfe", ": not JSON"),
    ("[]", ": expected an object"),
    ('{"unhealthy_nodes": "c 195:0"}', ".unhealthy_nodes: expected a list of strings"),
    ('{"unhealthy_nodes": [3]}', ".unhealthy_nodes[0]: expected a string"),
    ('{"devices": []}', ".devices: expected an object"),
    (f'{{"devices": {{"{KEY}": {{"published": "fine"}}}}}}',
     f".devices[{KEY!r}].published: expected one of healthy, degraded, unhealthy"),
    (f'{{"devices": {{"{KEY}": {{"published": "healthy", "reasons": "x"}}}}}}',
     f".devices[{KEY!r}].reasons: expected a list of strings"),
    ('{"time": "now"}', ".time: expected a number"),
])
def test_a_health_file_that_cannot_be_believed_is_one_line_naming_the_file_and_field(
        tmp_path: Path, content: str, field: str) -> None:
    (tmp_path / "health.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(StateFileError) as raised:
        healthverdicts.read(str(tmp_path))
    message = raised.value.message
    assert message.startswith(f"{tmp_path}/health.json{field}") and "\n" not in message, message


def test_the_dra_driver_keeps_its_taints_when_health_json_breaks(tmp_path: Path) -> None:
    """It read such a file as "nothing out" before: a device the loop took out went back in the slices."""
    from devinject.dra.driver import read_health

    healthverdicts.write(str(tmp_path), _verdicts())
    health = read_health(str(tmp_path))
    assert health.nodes == {"c 195:2"} and health.reasons == {KEY: ("Xid 79",)}
    (tmp_path / "health.json").write_text('{"unhealthy_nodes": ["c 1')
    with pytest.raises(StateFileError, match=f"^{tmp_path}/health.json: not JSON"):
        read_health(str(tmp_path))


# --- the DRA driver's checkpoint -----------------------------------------------------------------------------
CLAIM_UID = "0b7f8e7c-1111-4c1b-9a55-000000000001"
CLAIMS: dict[str, dict[str, object]] = {CLAIM_UID: {
    "namespace": "default", "name": "held", "spec": "/var/run/cdi/dra.devinject.io-x.json",
    "devices": [{"requests": ["gpu"], "pool": "node1", "device": "gpu-0", "cdi": ["k=x"]}], "pods": ["p1"],
    "ledger": [["nvidia.com/gpu=0", ["c 195:0"], []]]}}


def _checkpoint(tmp_path: Path) -> Path:
    from devinject.dra.claims import Checkpoint
    from devinject.nodestate.claimcheckpoints import ClaimRecord

    path = tmp_path / "dra-dra.devinject.io.checkpoint.json"
    Checkpoint(str(path)).save({uid: ClaimRecord.from_json(claim) for uid, claim in CLAIMS.items()})
    return path


def test_a_checkpoint_reads_back_what_was_saved_with_its_version_and_checksum(tmp_path: Path) -> None:
    from devinject.dra.claims import Checkpoint
    from devinject.nodestate.claimcheckpoints import CHECKPOINT_VERSION, checksum_of

    path = _checkpoint(tmp_path)
    raw = json.loads(path.read_text())
    assert raw["version"] == CHECKPOINT_VERSION == 2 and raw["checksum"] == checksum_of(CLAIMS)
    assert raw["checksum"].startswith("sha256:") and len(raw["checksum"]) == 7 + 64
    assert {uid: record.to_json() for uid, record in Checkpoint(str(path)).load().items()} == CLAIMS
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_checkpoint_beyond_the_size_cap_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read whole, up to statefile's cap, as every state file: a huge file is not taken into memory."""
    from devinject.dra import claims
    from devinject.dra.claims import Checkpoint, CheckpointError

    monkeypatch.setattr(claims, "MAX_BYTES", 1 << 20)
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(CheckpointError, match=r"checkpoint.json: corrupt checkpoint \(larger than 1048576 bytes\)"):
        Checkpoint(str(path)).load()


def test_a_checkpoint_from_before_checksums_is_still_read(tmp_path: Path) -> None:
    """An upgrade: the driver restarts on a version 1 checkpoint; its claims stay prepared."""
    from devinject.dra.claims import Checkpoint

    path = tmp_path / "dra-x.checkpoint.json"
    path.write_text(json.dumps({"version": 1, "claims": CLAIMS}))
    assert {uid: record.to_json() for uid, record in Checkpoint(str(path)).load().items()} == CLAIMS


def _without(text: str, key: str) -> str:
    return json.dumps({k: v for k, v in json.loads(text).items() if k != key})


def _flip_a_byte(text: str) -> str:
    at = text.index("c 195:0") + 6
    return text[:at] + "1" + text[at + 1:]  # c 195:1: the claim's GPU silently another one


@pytest.mark.parametrize(("change", "field"), [
    (_flip_a_byte, ".checksum: does not match its claims"),  # a disk's bit, or a hand's edit
    (lambda text: text.replace('"pods": ["p1"]', '"pods": ["p1", "intruder"]'), ".checksum: does not match"),
    (lambda text: text.replace('"version": 2', '"version": 3'), ".version: 3 is not a version this devinject "
                                                                "reads (1, 2)"),
    (lambda text: _without(text, "version"), ".version: None is not a version"),
    (lambda text: _without(text, "checksum"), ".checksum: expected a string"),
    (lambda text: text[: len(text) // 2], ": not JSON"),  # truncated
    (lambda text: "", ": not JSON"),
    (lambda text: "[]", ": expected an object"),
])
def test_a_corrupt_or_tampered_checkpoint_is_refused_naming_the_file_and_field(tmp_path: Path, change: object,
                                                                               field: str) -> None:
    """The checkpoint had a version but no checksum: a changed node or pod in it was believed, and the
    claim's devices booked as it said."""
    from devinject.dra.claims import Checkpoint, CheckpointError
    from devinject.nodestate.claimcheckpoints import parse_checkpoint

    path = _checkpoint(tmp_path)
    assert callable(change)
    path.write_text(change(path.read_text()))
    with pytest.raises(StateFileError) as raised:
        parse_checkpoint(path.read_bytes(), str(path))
    assert raised.value.message.startswith(f"{path}{field}"), raised.value.message
    with pytest.raises(CheckpointError, match=f"^{path}: corrupt checkpoint .*; no claim is prepared until"):
        Checkpoint(str(path)).load()


def test_the_ledger_rebuild_books_no_claim_from_a_tampered_checkpoint(tmp_path: Path) -> None:
    """The rebuild (ledger and its claims' copy both lost) books what the checkpoints hold: a tampered one is
    named in an event and left out, never believed."""
    from devinject.nodestate.claimcheckpoints import checkpointed_bookings

    path = _checkpoint(tmp_path)
    assert checkpointed_bookings(str(tmp_path)) == (
        {f"dra-claim:dra.devinject.io:{CLAIM_UID}": [("nvidia.com/gpu=0", ["c 195:0"], [])]},
        {f"dra-claim:dra.devinject.io:{CLAIM_UID}": ["p1"]}, [])
    path.write_text(_flip_a_byte(path.read_text()))
    assert checkpointed_bookings(str(tmp_path)) == ({}, {}, [path.name])


# --- the ledger ----------------------------------------------------------------------------------------------
def test_the_ledger_is_written_with_its_version_and_its_entries_read_back_as_records(tmp_path: Path) -> None:
    from devinject.nodestate.ledger import LEDGER_VERSION, Claim, Ledger, LedgerEntry

    Ledger(str(tmp_path)).book("c1", os.getpid(), (Claim("vendor.com/gpu=0", ("c 195:0",)),),
                               {"vendor.com/gpu": "exclusive"})
    raw = json.loads((tmp_path / "ledger.json").read_text())
    assert raw["version"] == LEDGER_VERSION == 1
    (cid, entry), = Ledger(str(tmp_path)).entries().items()
    assert cid == "c1" and entry.exclusive == ("c 195:0",) and entry.pid == os.getpid()
    assert entry.state == "active" and entry.holds({"c 195:0"}) and not entry.holds({"c 195:1"})
    assert LedgerEntry.from_json(entry.to_json()) == entry
    assert entry.to_json() == raw["allocations"]["c1"]


def test_reading_the_ledgers_entries_where_none_was_written_creates_nothing(tmp_path: Path) -> None:
    from devinject.nodestate.ledger import Ledger

    assert Ledger(str(tmp_path)).entries() == {}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("version", [2, "1", True])
def test_a_ledger_of_a_version_it_does_not_read_is_rebuilt_as_a_corrupt_one_is(tmp_path: Path,
                                                                               version: object) -> None:
    """A newer release's ledger after a downgrade: its bookings are not guessed at; it is kept aside and the
    ledger rebuilt from live evidence, as for any ledger that does not validate."""
    from devinject.nodestate.ledger import Ledger

    content = json.dumps({"version": version, "allocations": {}})
    (tmp_path / "ledger.json").write_text(content)
    Ledger(str(tmp_path)).snapshot()
    assert json.loads((tmp_path / "ledger.json").read_text())["version"] == 1  # rebuilt, as this release writes it
    (aside,) = tmp_path.glob("ledger.json.broken-*")
    assert aside.read_text() == content
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (rebuilt,) = [e for e in events if e["event"] == "ledger-rebuilt"]
    assert rebuilt["reason"] == f"version {version!r} is not one this devinject reads (1)"


def test_a_ledger_from_before_versions_is_read_as_version_1(tmp_path: Path) -> None:
    from devinject.nodestate.ledger import Ledger

    entry = {"devices": ["vendor.com/gpu=0"], "exclusive": ["c 195:0"], "shared": [], "pid": 1, "start_time": 1,
             "state": "reclaiming", "pods": ["p"], "plugin": "vendor.com/gpu"}
    (tmp_path / "ledger.json").write_text(json.dumps({"allocations": {"device-plugin:vendor.com/gpu:x": entry}}))
    assert Ledger(str(tmp_path)).read() is not None
    assert not list(tmp_path.glob("ledger.json.broken-*"))


# --- sharing.json and the profile-facts cache ----------------------------------------------------------------
def _state(tmp_path: Path) -> str:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    return str(state)


def test_time_slicing_reads_back_what_the_device_plugin_wrote(tmp_path: Path) -> None:
    from devinject.nodestate.profilefacts import TimeSlicing, read_time_slicing, write_time_slicing

    state = _state(tmp_path)
    assert read_time_slicing(state) is None
    write_time_slicing(state, {"nvidia.com/gpu": 4}, {"nvidia.com/gpu": "nvidia.com/gpu.shared"})
    assert read_time_slicing(state) == TimeSlicing({"nvidia.com/gpu": 4}, {"nvidia.com/gpu": "nvidia.com/gpu.shared"})
    assert json.loads(Path(state, "sharing.json").read_text())["version"] == 1


@pytest.mark.parametrize(("content", "field"), [
    ('{"version": 2, "time-slicing": {}}', ".version: 2 is not a version this devinject reads (1)"),
    ('{"time-slicing": {"nvidia.com/gpu": 4', ": not JSON"),  # truncated
    ('{"time-slicing": {"nvidia.com/gpu": true}}', ".time-slicing['nvidia.com/gpu']: expected an integer"),
    ('{"time-slicing": {"nvidia.com/gpu": 0}}', ".time-slicing['nvidia.com/gpu']: expected 1 to 1024 replicas"),
    ('{"time-slicing": {}, "resources": {"k": 1}}', ".resources['k']: expected a string"),
    ('{"resources": {}}', ".time-slicing: expected an object"),
])
def test_a_sharing_file_that_fails_is_named_and_counts_as_no_time_slicing(tmp_path: Path, content: str,
                                                                          field: str) -> None:
    from devinject.nodestate.profilefacts import read_time_slicing, served_resources, time_slicing

    state = _state(tmp_path)
    Path(state, "sharing.json").write_text(content)
    with pytest.raises(StateFileError) as raised:
        read_time_slicing(state)
    assert raised.value.message.startswith(f"{state}/sharing.json{field}"), raised.value.message
    assert time_slicing(state) == {} and served_resources(state) == {}  # every kind booked as its profile says


@pytest.mark.parametrize("content", ['{"fingerprint": "x", "policy": {}, "request_env": {}}',  # before versions
                                     '{"version": 9}', '{"version": 1, "fingerprint": "', "[]",
                                     '{"version": 1, "fingerprint": "x", "policy": {"k": 1}, "request_env": {}}'])
def test_a_profile_facts_cache_that_fails_is_a_miss_read_again_and_rewritten(tmp_path: Path, content: str) -> None:
    from devinject.nodestate.profilefacts import FACTS_VERSION, ProfileFacts, sharing_policy

    state = _state(tmp_path)
    facts = sharing_policy(state)
    cache = Path(state, "profile-facts.json")
    written = ProfileFacts.from_json(json.loads(cache.read_text()), str(cache))
    assert written.version == FACTS_VERSION and written.policy == facts
    assert ProfileFacts.from_json(written.to_json(), str(cache)) == written
    cache.write_text(content)
    assert sharing_policy(state) == facts
    assert ProfileFacts.from_json(json.loads(cache.read_text()), str(cache)) == written


# --- the devices' event rings --------------------------------------------------------------------------------
def test_the_event_ring_reads_back_what_was_recorded_and_a_ring_from_before_versions(tmp_path: Path) -> None:
    from devinject.nodestate import events

    state = _state(tmp_path)
    events.record(state, "taken-out", device=KEY, reason="Xid 79")
    ring = events.read_ring(state)
    assert ring.version == events.RING_VERSION and [e["event"] for e in ring.rings[KEY]] == ["taken-out"]
    assert events.DeviceEvents.from_json(ring.to_json(), "x") == ring
    Path(state, "device-events.json").write_text(json.dumps({KEY: ring.rings[KEY]}))  # as written before versions
    assert events.device_history(state, KEY) == ring.rings


@pytest.mark.parametrize(("content", "field"), [
    ('{"version": 2, "devices": {}}', ".version: 2 is not a version this devinject reads (1)"),
    ('{"version": 1, "devices": {"k": [{"event": "x"', ": not JSON"),  # truncated
    ('{"version": 1, "devices": {"k": "x"}}', ".devices['k']: expected a list of events"),
    ('{"version": 1, "devices": {"k": [3]}}', ".devices['k'][0]: expected an object"),
    ('{"version": 1}', ".devices: expected an object"),
])
def test_a_ring_that_fails_is_named_to_its_reader_and_replaced_by_the_next_event(tmp_path: Path, content: str,
                                                                                  field: str) -> None:
    """It read as "no events" before: `events` showed nothing for a device with a history."""
    from devinject.nodestate import events

    state = _state(tmp_path)
    Path(state, "device-events.json").write_text(content)
    with pytest.raises(StateFileError) as raised:
        events.device_history(state)
    assert raised.value.message.startswith(f"{state}/device-events.json{field}"), raised.value.message
    events.record(state, "put-back", device=KEY)
    assert [e["event"] for e in events.device_history(state)[KEY]] == ["put-back"]


def test_the_hooks_lock_free_ledger_read_takes_only_a_valid_ledger_file_of_its_own(tmp_path: Path) -> None:
    """The grants' reader (a claim's devices for a pod, the pods that keep bindings) was a second ledger
    reader of its own that took any entry it could parse; it is the ledger's read_entries now."""
    from devinject.nodestate.ledger import Claim, Ledger, read_entries

    Ledger(str(tmp_path)).book("c1", os.getpid(), (Claim("vendor.com/gpu=0", ("c 195:0",)),),
                               {"vendor.com/gpu": "exclusive"}, for_pods=("pod-a",))
    assert read_entries(str(tmp_path)) == Ledger(str(tmp_path)).entries()
    assert read_entries(str(tmp_path))["c1"].pods == ("pod-a",)
    ledger = tmp_path / "ledger.json"
    ledger.chmod(0o666)
    assert read_entries(str(tmp_path)) == {}  # anyone could have written it
    ledger.chmod(0o644)
    ledger.rename(tmp_path / "real.json")
    ledger.symlink_to(tmp_path / "real.json")
    assert read_entries(str(tmp_path)) == {}  # no link followed
    ledger.unlink()
    ledger.write_text(json.dumps({"allocations": {"c1": {"devices": [], "exclusive": "c 195:0", "shared": [],
                                                         "pid": 1, "start_time": 1, "state": "active"}}}))
    assert read_entries(str(tmp_path)) == {}  # fails validation: the next booking rebuilds it
