"""The DRA driver's state is one object (dra/driver.py DriverState) and `desired()` is a query: asking for
the slices any number of times changes nothing of the driver's (the taints' times, the offers it knows, the
health stream, health.json's last read); publishing takes in what the query learned (`adopt`)."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import fields
from pathlib import Path

from devinject.dra.driver import DraDriver, DriverState
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver

EVENTS_AND_LOCKS = {"lock", "publishing", "wake", "rediscover", "loop", "loop_thread", "loop_stop", "node"}


def state_of(driver: DraDriver) -> dict[str, object]:
    """The driver's state as values (its locks, signals and node aside), and the health stream's verdicts."""
    state = driver.state
    out = {f.name: copy.deepcopy(getattr(state, f.name)) for f in fields(DriverState)
           if f.name not in EVENTS_AND_LOCKS | {"inventory", "host"}}
    out["health stream"] = driver.health.snapshot()[1]
    return out


def test_desired_is_a_query_and_publishing_adopts_what_it_learned(tmp_path: Path) -> None:
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    api = FakeApi()
    driver = make_driver(dirs, api)
    driver.discover()
    Path(dirs["state"], "health.json").write_text(json.dumps({"unhealthy_nodes": ["c 195:2"]}))  # 18:00.0 out
    before = state_of(driver)
    first = driver.desired()
    tainted = [d for s in first for d in s["spec"].get("devices", []) if d.get("taints")]
    assert [d["name"] for d in tainted] == ["gpu-0000-18-00-0"]
    assert driver.desired() == first and state_of(driver) == before  # asked twice: nothing changed
    assert driver.refresh(rediscover=False)
    after = state_of(driver)
    assert after["published"] == api.slices
    assert list(after["since"]) == [(GPU_POOL, "gpu-0000-18-00-0", "dra.devinject.io/fault")]  # type: ignore[arg-type]
    assert after["health stream"][(GPU_POOL, "gpu-0000-18-00-0")][0] is False  # type: ignore[index]
