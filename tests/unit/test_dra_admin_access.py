"""adminAccess claims (KEP-5018, GA in 1.36: monitoring, in a namespace labelled
`resource.kubernetes.io/admin-access: "true"`): the scheduler allocates their devices to other claims too.
Before, such a claim was booked exclusive and the workload's own claim on that GPU was then refused ("held
by"), whichever came first. Now it gets its spec (access) and books nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Ledger
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver

GPU = "gpu-0000-2a-00-0"
ADMIN, WORKLOAD = "0b7f8e7c-5555-4c1b-9a55-000000000001", "0b7f8e7c-5555-4c1b-9a55-000000000002"


@pytest.fixture
def driver(tmp_path: Path) -> DraDriver:
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    api = FakeApi()
    api.add("monitor", ADMIN, [(GPU_POOL, GPU)])
    for result in api.claims[("default", "monitor")]["status"]["allocation"]["devices"]["results"]:
        result["adminAccess"] = True
    api.add("workload", WORKLOAD, [(GPU_POOL, GPU)])
    return make_driver(dirs, api)


@pytest.mark.parametrize("first", ["monitor", "workload"])
def test_an_admin_access_claim_gets_the_gpu_and_never_blocks_the_workload(driver: DraDriver, first: str) -> None:
    order = [("monitor", ADMIN), ("workload", WORKLOAD)]
    for name, uid in (order if first == "monitor" else order[::-1]):
        prepared = driver.preparer.prepare("default", name, uid)
        assert [d.device for d in prepared] == [GPU]
        assert os.path.exists(driver.preparer.spec_path(uid))
    allocations = Ledger(driver.opts.state_dir).snapshot()["allocations"]
    admin = allocations[f"dra-claim:dra.devinject.io:{ADMIN}"]
    workload = allocations[f"dra-claim:dra.devinject.io:{WORKLOAD}"]
    assert (admin["exclusive"], admin.get("shared", [])) == ([], [])
    assert workload["exclusive"] == ["c 195:3"]
    driver.preparer.unprepare(ADMIN)
    driver.preparer.unprepare(WORKLOAD)
