"""IMEX channels in the DRA driver (issue 21): the DGX A100 fixture's two channels are a pool of their own,
`channel-N` with `type`/`id` as NVIDIA's DRA driver publishes them and no PCI attribute; a claim for one is
prepared through the spec pipeline `generate` uses (the channel spec's device `N`), one claim-scoped spec
with exactly that channel's node, booked in the ledger; a channel whose node is gone (or that `watch` took
out) stays in the slice with a taint naming why and is unhealthy in the health stream. Each fails on the
driver before channels (the taints: on the driver before taints)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devinject.core.errors import LedgerError
from devinject.discovery.node import Node
from devinject.dra.driver import DraDriver
from devinject.dra.slices import DRIVER, offers, resource_slices
from devinject.nodestate.ledger import Claim, Ledger
from devinject.specs.generate import GenerateOptions, generate_specs
from tests.conftest import HOSTS
from tests.integration import test_dra_driver
from tests.integration.test_dra_driver import FakeApi, make_driver

NODE = "node1"
POOL = f"{NODE}-nvidia-com-imex-channel"
UID = "0b7f8e7c-3333-4c1b-9a55-000000000001"
CHANNEL1 = "c 233:1"  # /dev/nvidia-caps-imex-channels/channel1: the fixture's region 233, minor 1
DGX = HOSTS / "dgx-a100-mig"

dirs = test_dra_driver.dirs  # its fixture: the plugin, registry, CDI and state directories


def devices_of(slices: list[dict[str, Any]], pool: str = POOL) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices if s["spec"]["pool"]["name"] == pool for d in s["spec"].get("devices", [])}


def test_channels_are_a_pool_of_their_own_with_what_they_are() -> None:
    slices = resource_slices(DRIVER, NODE, offers(Node(str(DGX)), NODE))
    (channel_slice,) = [s for s in slices if s["spec"]["pool"]["name"] == POOL]
    assert channel_slice["spec"]["pool"]["resourceSliceCount"] == 1 and "sharedCounters" not in channel_slice["spec"]
    devices = devices_of(slices)
    assert sorted(devices) == ["channel-0", "channel-1"]
    assert devices["channel-1"] == {"name": "channel-1", "attributes": {
        "kind": {"string": "nvidia.com/imex-channel"}, "vendor": {"string": "NVIDIA"},
        "type": {"string": "channel"}, "id": {"int": 1}, "partition": {"string": "whole"}}}
    # no pciBusID, pcieRoot, numaNode: no PCI function
    # the GPUs' pool is unchanged beside it
    assert devices_of(slices, f"{NODE}-nvidia-com-gpu")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A copy of the DGX fixture, whose channel nodes a test may remove."""
    root = tmp_path / "host"
    shutil.copytree(DGX, root, symlinks=True)
    return root


def driver_over(dirs: dict[str, str], api: FakeApi, root: Path) -> DraDriver:
    """The integration tests' driver (no sockets: claims go through its Preparer) over another host tree."""
    opts = make_driver(dirs, api).opts
    return DraDriver(replace(opts, generate=replace(opts.generate, root=str(root))), api)


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def driver(dirs: dict[str, str], api: FakeApi, host: Path) -> Iterator[DraDriver]:
    yield driver_over(dirs, api, host)


def test_a_channel_claim_is_prepared_through_the_channel_spec(driver: DraDriver, api: FakeApi,
                                                              dirs: dict[str, str], host: Path) -> None:
    api.add("imex", UID, [(POOL, "channel-1")], request="channel")
    (prepared,) = driver.preparer.prepare("default", "imex", UID)
    assert (prepared.pool, prepared.device, prepared.cdi_ids) == (POOL, "channel-1",
                                                                 (f"{DRIVER}/claim={UID}-channel-1",))
    spec = json.loads(Path(dirs["cdi"], f"{DRIVER}-{UID}.json").read_text())
    (device,) = spec["devices"]
    assert device["name"] == f"{UID}-channel-1"
    # exactly the node generate's channel spec gives channel 1, nothing of channel 0
    (channels,) = [s for s in generate_specs(GenerateOptions(root=str(host), hook_path="/usr/bin/devinject"))
                   if s.kind == "nvidia.com/imex-channel"]
    (one,) = [d for d in channels.devices if d.name == "1"]
    assert [(n["path"], n["major"], n["minor"]) for n in device["containerEdits"]["deviceNodes"]] == \
        [(n.path, n.major, n.minor) for n in one.edits.device_nodes] == \
        [("/dev/nvidia-caps-imex-channels/channel1", 233, 1)]
    assert "channel0" not in json.dumps(spec)
    # booked for the claim: a container cannot take the channel while it is prepared, and can once unprepared
    ledger = Ledger(dirs["state"])
    mine = Claim("nvidia.com/imex-channel=1", (CHANNEL1,))
    with pytest.raises(LedgerError, match="dra-claim"):
        ledger.book("container-a", os.getpid(), (mine,))
    assert [b.to_json() for b in driver.preparer.prepared()[UID].bookings] == [
        ["nvidia.com/imex-channel=channel-1", [CHANNEL1], []]]
    driver.preparer.unprepare(UID)
    assert os.listdir(dirs["cdi"]) == []
    ledger.book("container-a", os.getpid(), (mine,))


def test_a_claim_for_a_gpu_and_a_channel_is_one_spec(driver: DraDriver, api: FakeApi, dirs: dict[str, str]) -> None:
    gpu = next(o for o in driver.discover().offers.values() if o.kind == "nvidia.com/gpu" and o.partition is None)
    api.add("both", UID, [(gpu.pool, gpu.name), (POOL, "channel-0")])
    prepared = driver.preparer.prepare("default", "both", UID)
    assert [p.device for p in prepared] == [gpu.name, "channel-0"]
    (spec_file,) = os.listdir(dirs["cdi"])
    spec = json.loads(Path(dirs["cdi"], spec_file).read_text())
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert nodes[f"{UID}-channel-0"] == ["/dev/nvidia-caps-imex-channels/channel0"]
    assert all("imex" not in p for p in nodes[f"{UID}-{gpu.name}"])


def taints(slices: list[dict[str, Any]], name: str) -> list[tuple[str, str]]:
    """A device's taints as (key, effect)."""
    return [(t["key"], t["effect"]) for t in devices_of(slices)[name].get("taints", [])]


def health_of(driver: DraDriver) -> dict[tuple[str, str], tuple[bool, str]]:
    return driver.health.snapshot()[1]


def test_a_channel_whose_node_is_gone_stays_tainted_and_is_unhealthy(driver: DraDriver, api: FakeApi,
                                                                      host: Path) -> None:
    driver.refresh()
    assert sorted(devices_of(api.slices)) == ["channel-0", "channel-1"]
    assert health_of(driver)[(POOL, "channel-1")] == (True, "")
    (host / "dev/nvidia-caps-imex-channels/channel1").unlink()
    assert driver.refresh()
    assert sorted(devices_of(api.slices)) == ["channel-0", "channel-1"]
    assert taints(api.slices, "channel-1") == [(f"{DRIVER}/gone", "NoSchedule")]
    assert taints(api.slices, "channel-0") == []
    assert health_of(driver)[(POOL, "channel-1")] == (False, "/dev/nvidia-caps-imex-channels/channel1: no such node")
    assert (POOL, "channel-1") not in driver.inventory().offers  # and a claim on it is not prepared
    (host / "dev/nvidia-caps-imex-channels/channel1").touch()  # back: in the slice and healthy again
    assert driver.refresh()
    assert sorted(devices_of(api.slices)) == ["channel-0", "channel-1"]
    assert taints(api.slices, "channel-1") == []
    assert health_of(driver)[(POOL, "channel-1")] == (True, "")


def test_a_channel_watch_took_out_stays_tainted(driver: DraDriver, api: FakeApi, dirs: dict[str, str]) -> None:
    Path(dirs["state"], "health.json").write_text(json.dumps({"unhealthy_nodes": [CHANNEL1]}))
    driver.refresh()
    assert taints(api.slices, "channel-1") == [(f"{DRIVER}/fault", "NoSchedule")]
    assert taints(api.slices, "channel-0") == []
    assert health_of(driver)[(POOL, "channel-1")] == (False, "taken out by the node's health checks")


def test_a_channel_node_with_other_numbers_stays_tainted(driver: DraDriver, api: FakeApi, host: Path) -> None:
    """A real char node in channel 1's place with another device's numbers (1:3, /dev/null's): not the channel."""
    if os.geteuid() != 0:
        pytest.fail("needs root (mknod)")
    node = host / "dev/nvidia-caps-imex-channels/channel1"
    node.unlink()
    os.mknod(node, 0o020666, os.makedev(1, 3))
    driver.refresh()
    assert taints(api.slices, "channel-1") == [(f"{DRIVER}/node-mismatch", "NoSchedule")]
    assert health_of(driver)[(POOL, "channel-1")] == (
        False, "/dev/nvidia-caps-imex-channels/channel1: is c 1:3, not c 233:1")
    node.unlink()
    os.mknod(node, 0o020666, os.makedev(233, 1))  # its own numbers: back
    driver.refresh()
    assert sorted(devices_of(api.slices)) == ["channel-0", "channel-1"]
    assert taints(api.slices, "channel-1") == []
