"""A claim's prepare is a plan (Preparer.plan_claim: nothing written) and its effects applied one by one,
each with its undo (core/undo.py): a failure after any effect leaves the node exactly as it was before the
prepare (the ledger, the checkpoint, the CDI specs, the device metadata, the MPS daemons), and the claim
prepares afterwards. An unprepare that fails at any step is finished by the kubelet's retry."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.core.undo import Effect, nothing
from devinject.dra.claims import ClaimPlan, Preparer
from devinject.dra.devicemetadata import MetadataFiles
from devinject.dra.driver import DraDriver
from devinject.nodestate.claimcheckpoints import ClaimRecord
from devinject.nodestate.ledger import Ledger
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver
from tests.unit.test_dra_checkpoint_records import MPS_CONFIG, RecordedMps

UID = "0b7f8e7c-7777-4c1b-9a55-000000000001"  # the MPS claim whose prepare fails
OTHER = "0b7f8e7c-7777-4c1b-9a55-000000000002"  # a claim prepared before it, that stays
GPU_ADDRESS = "0000:2a:00.0"
EFFECTS = ["metadata", "spec", "booking", f"mps {GPU_ADDRESS}", "checkpoint"]


class Injected(Exception):
    pass


@pytest.fixture
def driver(tmp_path: Path) -> DraDriver:
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    api = FakeApi()
    api.add("mps", UID, [(GPU_POOL, "gpu-0000-2a-00-0")], config=MPS_CONFIG)
    api.add("other", OTHER, [(GPU_POOL, "gpu-0000-18-00-0")])
    driver = make_driver(dirs, api)
    driver.preparer.metadata = MetadataFiles(os.path.join(dirs["plugins"], "metadata"), "dra.devinject.io")
    driver.preparer.mps = RecordedMps(os.path.join(dirs["state"], "mps"))  # type: ignore[assignment]
    driver.preparer.prepare("default", "other", OTHER)
    return driver


def tree(top: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(top):
        for name in files:
            out[os.path.relpath(os.path.join(root, name), top)] = Path(root, name).read_bytes()
    return out


def node_state(driver: DraDriver) -> dict[str, object]:
    """What a prepare changes on the node: the claims' specs and metadata files byte for byte, the
    checkpoint byte for byte, the ledger's bookings and the MPS daemons."""
    preparer = driver.preparer
    assert isinstance(preparer.mps, RecordedMps)
    return {"cdi": tree(driver.opts.cdi_dir), "metadata": tree(os.path.join(driver.opts.plugin_dir, "metadata")),
            "checkpoint": Path(preparer.checkpoint.path).read_bytes(), "mps": preparer.mps.recorded(),
            "bookings": Ledger(driver.opts.state_dir).read() or {}}


def failing_after(name: str, broken_undo: str | None = None) -> Callable[..., list[Effect]]:
    """Preparer._effects with a failure right after the effect `name` is done (and `broken_undo`'s undo
    doing nothing: the test's own check that it sees what an undo leaves)."""
    effects_of = Preparer._effects

    def effects(self: Preparer, plan: ClaimPlan, claims: dict[str, ClaimRecord]) -> list[Effect]:
        out = []
        for effect in effects_of(self, plan, claims):
            if effect.name == broken_undo:
                effect = replace(effect, undo=nothing)
            out.append(effect)
            if effect.name == name:
                out.append(Effect("injected", _raise, nothing))
        return out
    return effects


def _raise() -> None:
    raise Injected("injected after the effect")


def test_the_plan_has_every_effect_the_tests_fail_after(driver: DraDriver,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str] = []
    effects_of = Preparer._effects

    def recorded(self: Preparer, plan: ClaimPlan, claims: dict[str, ClaimRecord]) -> list[Effect]:
        effects = effects_of(self, plan, claims)
        names.extend(e.name for e in effects)
        return effects
    monkeypatch.setattr(Preparer, "_effects", recorded)
    driver.preparer.prepare("default", "mps", UID)
    assert names == EFFECTS


@pytest.mark.parametrize("name", EFFECTS)
def test_a_failure_after_each_effect_leaves_the_node_as_it_was(name: str, driver: DraDriver,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    before = node_state(driver)
    monkeypatch.setattr(Preparer, "_effects", failing_after(name))
    with pytest.raises(Injected):
        driver.preparer.prepare("default", "mps", UID)
    assert node_state(driver) == before
    monkeypatch.undo()
    (device,) = driver.preparer.prepare("default", "mps", UID)  # nothing left in its way
    assert device.device == "gpu-0000-2a-00-0" and UID in driver.preparer.prepared()


@pytest.mark.parametrize("name", EFFECTS)
def test_the_check_sees_an_undo_that_does_nothing(name: str, driver: DraDriver,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    before = node_state(driver)
    monkeypatch.setattr(Preparer, "_effects", failing_after(EFFECTS[-1], broken_undo=name))
    with pytest.raises(Injected):
        driver.preparer.prepare("default", "mps", UID)
    assert node_state(driver) != before


UNPREPARE_STEPS = ["_remove_files", "release", "_unbook", "save"]


@pytest.mark.parametrize("step", UNPREPARE_STEPS)
def test_an_unprepare_that_fails_at_any_step_is_finished_by_the_retry(step: str, driver: DraDriver,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    preparer = driver.preparer
    before = node_state(driver)
    preparer.prepare("default", "mps", UID)
    owner = {"release": preparer.mps, "save": preparer.checkpoint}.get(step, preparer)
    real = getattr(owner, step)

    def failing(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)
        raise Injected(step)
    monkeypatch.setattr(owner, step, failing)
    with pytest.raises(Injected):
        preparer.unprepare(UID)
    monkeypatch.undo()
    assert UID in preparer.prepared() or step == "save"  # checkpointed until the last step is done
    preparer.unprepare(UID)
    assert node_state(driver) == before
