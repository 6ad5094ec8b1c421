"""The DRA checkpoint's claims as typed records (nodestate/claimcheckpoints.py ClaimRecord): the bytes on disk
are the ones v0.1.0 writes and reads. Goldens in tests/fixtures/dra-checkpoints/ were written by the driver
before the records existed (a plain claim reserved for a pod; two shares of one GPU, one of them an MPS
client, with consumable capacity; an admin-access claim), their claim spec paths put under /var/run/cdi:
each reads and writes back byte for byte, and a prepare of the same claims today writes them again. A
version 1 checkpoint (no checksum, no pods) still reads, and its claims are kept as they were."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from devinject.agent.mps import Daemon
from devinject.core import jsonlite
from devinject.dra.driver import DraDriver
from devinject.nodestate.claimcheckpoints import ClaimRecord, DraCheckpoint, parse_checkpoint
from devinject.nodestate.statefile import StateFileError
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver
from tests.unit.test_dra_capacity import FOUR_SHARES, GPU, SHARE_A, SHARE_B, UID_A, UID_B, share
from tests.unit.test_ledger_pods import POD

GOLDEN = Path(__file__).parent.parent / "fixtures" / "dra-checkpoints"
UID = "0b7f8e7c-6666-4c1b-9a55-000000000001"
ADMIN_UID = "0b7f8e7c-6666-4c1b-9a55-000000000002"
MPS_CONFIG = [{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": "dra.devinject.io", "parameters": {
    "apiVersion": "dra.devinject.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}}}]


class RecordedMps:
    """MPS daemons as the preparer sees them, kept in memory: what is acquired and released, never run."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.held: dict[str, list[str]] = {}

    def daemon(self, holder: str) -> Daemon:
        top = os.path.join(self.base, holder)
        return Daemon(holder, top, os.path.join(top, "pipe"), os.path.join(top, "log"))

    def acquire(self, gpu: str, holder: str, visible: str) -> Daemon:
        self.held.setdefault(gpu, []).append(holder)
        return self.daemon(holder)

    def release(self, gpu: str, holder: str) -> bool:
        holders = self.held.get(gpu, [])
        if holder not in holders:
            return False
        holders.remove(holder)
        if not holders:
            del self.held[gpu]
        return True

    def recorded(self) -> dict[str, list[str]]:
        return {gpu: sorted(holders) for gpu, holders in self.held.items()}

    def check(self) -> list[str]:
        return []


def checksummed(claims: dict[str, Any]) -> bytes:
    """A version 2 checkpoint of these claims (JSON as they are), its checksum made as the format makes it
    (sha256 of the claims' sorted JSON), independently of the module's encoder."""
    checksum = "sha256:" + hashlib.sha256(jsonlite.dumps(claims, sort_keys=True).encode()).hexdigest()
    return jsonlite.dumps({"version": 2, "checksum": checksum, "claims": claims}, sort_keys=True).encode()


def normalized(data: bytes, cdi_dir: str) -> bytes:
    """A checkpoint written under a test's temporary CDI dir as it would read under /var/run/cdi: its claims'
    spec paths moved, the checksum made again."""
    claims = json.loads(data)["claims"]
    for entry in claims.values():
        entry["spec"] = entry["spec"].replace(cdi_dir, "/var/run/cdi")
    return checksummed(claims)


def plain(driver_of: type[DraDriver] | None, dirs: dict[str, str]) -> DraDriver:
    api = FakeApi()
    api.add("held", UID, [(GPU_POOL, "gpu-0000-2a-00-0")])
    api.claims[("default", "held")]["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": POD}]
    api.add("watcher", ADMIN_UID, [(GPU_POOL, "gpu-0000-18-00-0")])
    api.claims[("default", "watcher")]["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    driver = make_driver(dirs, api)
    driver.preparer.prepare("default", "held", UID)
    driver.preparer.prepare("default", "watcher", ADMIN_UID)
    return driver


def shared(driver_of: type[DraDriver] | None, dirs: dict[str, str]) -> DraDriver:
    from dataclasses import replace

    api = FakeApi()
    share(api, "a", UID_A, [(SHARE_A, "10Gi")])
    share(api, "b", UID_B, [(SHARE_B, "10Gi"), ("5b0c2f0e-bbbb-4c1b-9a55-00000000000d", "4Gi")])
    for name in ("a", "b"):
        api.claims[("default", name)]["status"]["allocation"]["devices"]["config"] = MPS_CONFIG
    driver = make_driver(dirs, api)
    driver.opts = replace(driver.opts, capacity=FOUR_SHARES)
    driver.preparer.mps = RecordedMps(os.path.join(dirs["state"], "mps"))  # type: ignore[assignment]
    driver.preparer.prepare("default", "a", UID_A)
    driver.preparer.prepare("default", "b", UID_B)
    return driver


SCENARIOS = {"plain": plain, "shared": shared}


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(out["state"], mode=0o755)
    return out


def written(scenario: str, dirs: dict[str, str]) -> bytes:
    driver = SCENARIOS[scenario](None, dirs)
    return normalized(Path(driver.preparer.checkpoint.path).read_bytes(), dirs["cdi"])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_prepare_writes_the_golden_checkpoint(scenario: str, dirs: dict[str, str]) -> None:
    assert written(scenario, dirs) == (GOLDEN / f"{scenario}.json").read_bytes()


V1 = {"version": 1, "claims": {UID: {
    "namespace": "default", "name": "old", "spec": f"/var/run/cdi/dra.devinject.io-{UID}.json",
    "devices": [{"requests": ["gpus"], "pool": GPU_POOL, "device": GPU,
                 "cdi": [f"dra.devinject.io/claim={UID}-{GPU}"]}],
    "ledger": [[f"nvidia.com/gpu={GPU}", ["c 195:3"], []]], "note": {"kept": [1, None, True]}}}}


@pytest.mark.parametrize("golden", sorted(p.name for p in GOLDEN.glob("*.json")))
def test_a_golden_checkpoint_reads_back_and_writes_out_byte_for_byte(golden: str) -> None:
    data = (GOLDEN / golden).read_bytes()
    checkpoint = parse_checkpoint(data, golden)
    assert all(isinstance(record, ClaimRecord) for record in checkpoint.claims.values())
    assert checkpoint.encode() == data
    assert DraCheckpoint(dict(checkpoint.claims)).encode() == data  # made again from the records alone


def test_a_version_1_checkpoint_reads_and_keeps_its_claims_as_they_were() -> None:
    checkpoint = parse_checkpoint(jsonlite.dumps(V1).encode(), "v1")
    record = checkpoint.claims[UID]
    assert checkpoint.version == 1 and record.pods is None and record.sharing is None and record.mps is None
    assert record.bookings[0].nodes == ("c 195:3",) and record.devices[0].share is None
    written = json.loads(checkpoint.encode())
    assert written["version"] == 2 and written["claims"] == V1["claims"]  # the unknown field too
    assert checkpoint.encode() == checksummed(V1["claims"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("namespace", 3, "a namespace or name that is not a string"),
    ("mps", {"0000:2a:00.0": 0}, "mps is not GPU -> name"),
    ("sharing", [], "mps is not GPU -> name, or sharing not request -> settings"),
    ("ledger", {}, "ledger is not a list"),
    ("pods", "p", "pods is not a list of pod UIDs"),
])
def test_a_claim_field_the_record_cannot_hold_is_refused(field: str, value: object, problem: str) -> None:
    claims = json.loads(json.dumps(V1["claims"]))
    claims[UID][field] = value
    with pytest.raises(StateFileError, match=f"claim {UID}: {problem}"):
        parse_checkpoint(checksummed(claims), "ckpt")
