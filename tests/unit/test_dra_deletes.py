"""What the DRA driver deletes: only the spec path it derives from its own name and a checked claim UID.
Before, NodeUnprepareResources with uid `x/../../victim` unlinked a file outside the CDI dir (given a directory
`dra.devinject.io-x` there), a checkpoint entry's `spec` naming any file got that file unlinked, and one
driver's start removed the claim specs of another whose name it prefixes (`dra.devinject.io-mig`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devinject.dra.claims import Preparer
from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Ledger
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver
from tests.unit.test_dra_checkpoint_records import checksummed

UID = "0b7f8e7c-2222-4c1b-9a55-000000000001"


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    for name in ("state", "cdi"):
        os.makedirs(out[name], mode=0o755)
    return out


@pytest.fixture
def driver(dirs: dict[str, str]) -> DraDriver:
    api = FakeApi()
    api.add("held", UID, [(GPU_POOL, "gpu-0000-2a-00-0")])
    return make_driver(dirs, api)


@pytest.mark.parametrize("uid", ["x/../../victim", "..", "x/y", "-x", "X" * 64, "", "a\x00b", "a.b"])
def test_a_uid_that_walks_out_of_the_cdi_dir_is_refused_by_both_rpcs(driver: DraDriver, dirs: dict[str, str],
                                                                   uid: str) -> None:
    cdi = Path(dirs["cdi"])
    (cdi / "dra.devinject.io-x").mkdir()
    victim = cdi.parent / "victim.json"
    victim.write_text("{}")
    with pytest.raises(Exception, match="is not a Kubernetes UID"):
        driver.preparer.unprepare(uid)
    with pytest.raises(Exception, match="is not a Kubernetes UID"):
        driver.preparer.prepare("default", "held", uid)
    assert victim.exists()


def test_a_checkpoint_naming_another_file_gets_it_left_alone(driver: DraDriver, dirs: dict[str, str],
                                                             tmp_path: Path) -> None:
    driver.preparer.prepare("default", "held", UID)
    checkpoint = Path(dirs["state"], "dra-dra.devinject.io.checkpoint.json")
    data = json.loads(checkpoint.read_text())
    victim = tmp_path / "precious"
    victim.write_text("root's")
    data["claims"][UID]["spec"] = str(victim)
    checkpoint.write_bytes(checksummed(data["claims"]))  # whoever can write it can checksum it too
    driver.preparer.unprepare(UID)
    assert victim.read_text() == "root's"
    assert not Path(driver.preparer.spec_path(UID)).exists()  # its own spec: removed
    assert driver.preparer.prepared() == {}


def test_one_drivers_start_keeps_the_claims_of_a_driver_its_name_prefixes(driver: DraDriver,
                                                                         dirs: dict[str, str]) -> None:
    mig = Preparer("dra.devinject.io-mig", dirs["cdi"], dirs["state"], driver.inventory, driver.preparer.get_claim,
                   driver.opts.generate, Ledger(dirs["state"]))
    theirs = Path(mig.spec_path(UID))  # the second driver's claim spec (its checkpoint names it)
    theirs.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "dra.devinject.io-mig/claim", "devices": []}))
    assert theirs.name == f"dra.devinject.io-mig-{UID}.json"
    link = Path(dirs["cdi"], "dra.devinject.io-linked.json")
    outside = Path(dirs["cdi"]).parent / "outside.json"
    outside.write_text(json.dumps({"kind": "dra.devinject.io/claim"}))
    link.symlink_to(outside)
    orphan = Path(dirs["cdi"], "dra.devinject.io-0b7f8e7c-9999-4c1b-9a55-000000000009.json")
    orphan.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "dra.devinject.io/claim", "devices": []}))
    assert driver.preparer.clean_orphans() == ["0b7f8e7c-9999-4c1b-9a55-000000000009"]
    assert theirs.exists() and not orphan.exists() and outside.exists()


def test_the_api_servers_uids_and_dns_labels_are_uids() -> None:
    from devinject.dra.claims import valid_uid

    assert valid_uid(UID) and valid_uid("uid-good") and not valid_uid(UID.upper())
