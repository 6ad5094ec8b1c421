"""One node's state written and read by one devinject tree: run as a script by
tests/integration/test_state_formats_compat.py with PYTHONPATH at this tree's src or at a release's (v0.1.0's
`git archive`), so one release's agents read what another's wrote: an upgrade, and a rollback.

    python scenario.py write STATE CDI HOST PID   # real bookings and claims, as the agents make them
    python scenario.py read STATE CDI HOST PID    # what this tree reads of them (JSON on stdout), then goes on
                                                  # from them: claims prepared again, new ones, refusals

It imports devinject alone (never the tests: a release's tests are not what runs on a node) and only what
v0.1.0 already had. Should this tree's API move on, copy this file as the release's (scenario_v0_1_0.py) and
let the test run that one under the release's code."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import devinject
from devinject.agent import healthstate
from devinject.cdi.spec import load_file
from devinject.core.errors import DevinjectError
from devinject.dra.claims import PrepareError
from devinject.dra.driver import DraDriver, DraOptions
from devinject.nodestate import claimcheckpoints, events, grants, healthverdicts, profilefacts
from devinject.nodestate.ledger import Claim, Ledger
from devinject.specs.generate import GenerateOptions

DRIVER = "dra.devinject.io"
NODE = "node1"
GPU_POOL = f"{NODE}-nvidia-com-gpu"
PLUGIN_RESOURCE = "nvidia.com/gpu"
# the HGX fixture's GPUs: 0000:18 is /dev/nvidia2 (c 195:2), 0000:2a c 195:3, 0000:3a c 195:0, 0000:5d c 195:1,
# 0000:ab c 195:7
CLAIMED = ("claimed", "0b7f8e7c-aaaa-4c1b-9a55-000000000001", "gpu-0000-18-00-0")
ON_PLUGINS = ("on-plugins", "0b7f8e7c-aaaa-4c1b-9a55-000000000002", "gpu-0000-2a-00-0")
ON_CONTAINERS = ("on-containers", "0b7f8e7c-aaaa-4c1b-9a55-000000000003", "gpu-0000-3a-00-0")
ON_UNHEALTHY = ("on-unhealthy", "0b7f8e7c-aaaa-4c1b-9a55-000000000004", "gpu-0000-ab-00-0")
NEW = ("new", "0b7f8e7c-aaaa-4c1b-9a55-000000000005", "gpu-0000-5d-00-0")
CLAIM_POD = "11111111-2222-4333-8444-000000000001"
PLUGIN_POD = "11111111-2222-4333-8444-000000000002"
OTHER_POD = "11111111-2222-4333-8444-000000000003"
PLUGIN_DEVICE = "GPU-2a"
PLUGIN_NAME = "nvidia.com/gpu=0000:2a:00.0"
CONTAINER = "ctr-0000000000000000000000000000000000000000000000000000000000000001"
UNHEALTHY_KEY = "nvidia.com/gpu=0000:ab:00.0"
PUT_BACK_KEY = "nvidia.com/gpu=0000:5d:00.0"


class FakeApi:
    """The API server as the DRA driver sees it: slices published, claims read."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        for name, uid, device in (CLAIMED, ON_PLUGINS, ON_CONTAINERS, ON_UNHEALTHY, NEW):
            results = [{"request": "gpus", "driver": DRIVER, "pool": GPU_POOL, "device": device}]
            self.claims[("default", name)] = {
                "metadata": {"name": name, "namespace": "default", "uid": uid},
                "status": {"allocation": {"devices": {"results": results, "config": []}},
                           "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": CLAIM_POD}]}}

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        return {}

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(json.dumps(self.claims[(namespace, name)]))
        return out


def driver(state: str, cdi: str, host: str) -> DraDriver:
    gen = GenerateOptions(root=host, hook_path="/usr/bin/devinject")
    opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=os.path.join(state, "..", "plugins"),
                      registry_dir=os.path.join(state, "..", "registry"), cdi_dir=cdi, state_dir=state, rescan=3600)
    return DraDriver(opts, FakeApi())  # type: ignore[arg-type]  # the publisher's two calls


def prepare(dra: DraDriver, claim: tuple[str, str, str]) -> list[str] | str:
    """The CDI names the claim's devices got, or the refusal."""
    try:
        return sorted(name for d in dra.preparer.prepare("default", claim[0], claim[1]) for name in d.cdi_ids)
    except PrepareError as err:
        return f"refused: {err.message}"


def write(state: str, cdi: str, host: str, pid: int) -> None:
    dra = driver(state, cdi, host)
    healthverdicts.write(state, healthverdicts.HealthVerdicts(
        ("c 195:7",), {UNHEALTHY_KEY: healthverdicts.DeviceVerdict("unhealthy", "unhealthy", ("Xid 79",)),
                       PUT_BACK_KEY: healthverdicts.DeviceVerdict("healthy")}, 1700000000.0))
    assert isinstance(prepare(dra, CLAIMED), list)
    ledger = Ledger(state)
    ledger.book_plugin(PLUGIN_RESOURCE, {PLUGIN_DEVICE: Claim(PLUGIN_NAME, ("c 195:3",))},
                       pods={PLUGIN_DEVICE: [PLUGIN_POD]})
    token = grants.write_grant(state, PLUGIN_RESOURCE, (PLUGIN_NAME,))
    assert grants.redeem(state, [token], PLUGIN_POD) == ([PLUGIN_NAME], [])
    ledger.book(CONTAINER, pid, (Claim("nvidia.com/gpu=0000:3a:00.0", ("c 195:0",)),))
    profilefacts.write_time_slicing(state, {"nvidia.com/rdma": 2}, {"nvidia.com/rdma": "nvidia.com/rdma"})
    events.record(state, "health-changed", device=UNHEALTHY_KEY, status="unhealthy")
    tracked = healthstate.TrackedDevice("nvidia.com/gpu", "0000:ab:00.0", "unhealthy", "unhealthy", ("Xid 79",),
                                        ("c 195:7",), {"0000:ab:00.0": "10de:2330"})
    healthstate.save_state(state, healthstate.encode_state(healthstate.HealthState(
        {UNHEALTHY_KEY: tracked}, {"0000:ab:00.0": (1, 2)}, "boot-1", 4096, {"0000:ab:00.0": [79]})))
    healthstate.add_request(state, PUT_BACK_KEY, {"0000:5d:00.0": (0, 3)})
    # put-backs.json as the health loop keeps one it honoured (its writer has no other caller)
    healthstate._record_put_back(state, PUT_BACK_KEY, {"0000:5d:00.0": (0, 2)}, ("boot-1", 2048))


def _without_times(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in ("time", "start_time", "released_at")}


def files(state: str, cdi: str) -> dict[str, Any]:
    """Every state file as this tree's owners read it, less the times of the moment it was written."""
    ledger = Ledger(state)
    checkpoint = claimcheckpoints.checkpointed_bookings(state)
    verdicts = healthverdicts.read(state)
    assert verdicts is not None
    sliced = profilefacts.read_time_slicing(state)
    assert sliced is not None
    health = healthstate.load_state(state)
    assert health is not None
    tokens = sorted(name[:-5] for name in os.listdir(grants.grants_dir(state)) if name.endswith(".json"))
    spec_files = sorted(os.listdir(cdi))
    return {
        "ledger": {cid: _without_times(entry._asdict()) for cid, entry in sorted(ledger.entries().items())},
        "checkpoint": [sorted(checkpoint[0].items()), sorted(checkpoint[1].items()), checkpoint[2]],
        "claims": {uid: {k: entry[k] for k in ("namespace", "name", "devices", "pods") if k in entry}
                   for uid, entry in sorted(driver_claims(state).items())},
        "health": [list(verdicts.unhealthy_nodes), {k: v._asdict() for k, v in sorted(verdicts.devices.items())}],
        "sharing": [sliced.replicas, sliced.resources],
        "health_state": [{k: vars(v) for k, v in health.devices.items()}, health.aer, health.log_identity,
                         health.log_offset, health.log_errors],
        "put_back_requests": healthstate.take_requests(state),
        "put_backs": {k: [p.aer, p.log_identity, p.log_offset] for k, p in healthstate.load_put_backs(state).items()},
        "rebuilt_from_claims_copy": rebuilt_ledger(state),
        "events": {k: [_without_times(e) for e in ring] for k, ring in events.read_ring(state).rings.items()},
        "grants": [grants.redeem(state, tokens, PLUGIN_POD), grants.redeem(state, tokens, OTHER_POD)[0]],
        "claimed_for_pod": sorted(grants.claimed_for_pod(state, CLAIM_POD)),
        "specs": {name: [d.name for d in load_file(os.path.join(cdi, name)).devices] for name in spec_files},
    }


def rebuilt_ledger(state: str) -> list[str]:
    """The bookings a broken ledger is rebuilt with, in a copy of the state dir: the claims' and the device
    plugin's from ledger-claims.json and the checkpoint (not what this machine's processes hold)."""
    import shutil

    copy = f"{state}-rebuilt"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(state, copy)
    with open(os.path.join(copy, "ledger.json"), "w", encoding="utf-8") as broken:
        broken.write('{"allocations": {"x": {"exclus')
    entries = Ledger(copy).entries()
    shutil.rmtree(copy)
    return sorted(cid for cid, entry in entries.items() if not entry.recovered)


def driver_claims(state: str) -> dict[str, dict[str, Any]]:
    from devinject.dra.claims import Checkpoint

    return Checkpoint(claimcheckpoints.checkpoint_path(state, DRIVER)).load()


def read(state: str, cdi: str, host: str) -> dict[str, Any]:
    """What this tree reads, then what it does from there as an upgraded (or rolled back) agent would."""
    before = files(state, cdi)
    dra = driver(state, cdi, host)
    rebooked = dra.preparer.rebook()
    orphans = dra.preparer.clean_orphans()
    again = prepare(dra, CLAIMED)  # the kubelet asks again after a restart: the same devices
    on_plugins, on_containers, on_unhealthy = (prepare(dra, c) for c in (ON_PLUGINS, ON_CONTAINERS, ON_UNHEALTHY))
    new = prepare(dra, NEW)
    try:
        Ledger(state).book_plugin(PLUGIN_RESOURCE, {"GPU-18": Claim("nvidia.com/gpu=0000:18:00.0", ("c 195:2",))})
        plugin_on_claim = "booked"
    except DevinjectError as err:
        plugin_on_claim = f"refused: {err.message}"
    dra.preparer.unprepare(CLAIMED[1])
    return {"version": devinject.__version__, "read": before, "rebook_refused": rebooked, "orphans": orphans,
            "prepared_again": again, "on_plugins": on_plugins, "on_containers": on_containers,
            "on_unhealthy": on_unhealthy, "new": new, "plugin_on_claim": plugin_on_claim,
            "after": files(state, cdi)}


def main() -> None:
    verb, state, cdi, host, pid = sys.argv[1:]
    if verb == "write":
        write(state, cdi, host, int(pid))
        print(json.dumps({"version": devinject.__version__, "module": devinject.__file__}))
    else:
        print(json.dumps({**read(state, cdi, host), "module": devinject.__file__}, sort_keys=True, default=list))


if __name__ == "__main__":
    main()
