"""Time-slicing beside DRA on one node, over one ledger (docs/sharing.md): the device plugin books each replica
it hands out shared, so two pods' replicas of one GPU are both booked, and a DRA claim without a sharing config
(exclusive) is refused that GPU; a GPU a claim holds takes all its replicas out of the kubelet's list together,
and Allocate refuses them. The node as tests/integration/test_both_paths.py makes it, the plugin time-slicing
nvidia.com/gpu 2 ways."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.deviceplugin.sharing import SharingConfig, TimeSliced
from devinject.specs.generate import GenerateOptions
from tests.integration.test_both_paths import CLAIM, Node, wait
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, prepare, unprepare


class SharedNode(Node):
    def start_plugin(self) -> None:
        gen = GenerateOptions(root=str(self.root), hook_path="/usr/bin/devinject", kinds=("nvidia.com/gpu",))
        watch = WatchOptions(generate=gen, output_dir=self.tmp / "cdi-dp", state_dir=str(self.state), interval=0.1,
                             recheck=0.05, threshold=2, rescan=3600, uevents=False, probe_timeout=1.0)
        agent = DevicePluginAgent(PluginOptions(
            watch=watch, plugin_dir=str(self.plugin_dir), kubelet_poll=0.2, pods_dir=str(self.pods),
            ledger_poll=0.1, pod_grace=30.0, sharing=SharingConfig((TimeSliced("nvidia.com/gpu", 2),))))
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        self.plugin = (agent, thread, stop)
        assert self.kubelet.wait_for(lambda: self.kubelet.latest("nvidia.com/gpu")), "the plugin never registered"


@pytest.fixture
def node(host_copy, tmp_path) -> Iterator[SharedNode]:  # type: ignore[no-untyped-def]
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    one = SharedNode(host_copy("hgx-h100"), tmp_path, plugin_dir)
    try:
        yield one
    finally:
        one.close()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def test_two_pods_replicas_of_one_gpu_are_booked_shared_and_keep_an_exclusive_claim_out(node: SharedNode) -> None:
    assert sorted(node.kubelet.latest("nvidia.com/gpu"))[:2] == ["0000:18:00.0::0", "0000:18:00.0::1"]
    node.allocate("0000:18:00.0::0")
    node.allocate("0000:18:00.0::1")  # another pod's replica of the same GPU: no clash
    booked = node.bookings()
    assert sorted(booked) == ["device-plugin:nvidia.com/gpu:0000:18:00.0::0",
                              "device-plugin:nvidia.com/gpu:0000:18:00.0::1"]
    assert all(e["shared"] == ["c 195:2"] and e["exclusive"] == [] for e in booked.values())
    node.api.add("exclusive", CLAIM, [(GPU_POOL, "gpu-0000-18-00-0")])
    answer = prepare(node.driver, ("exclusive", CLAIM)).claims[CLAIM]
    assert "held by the device plugin: nvidia.com/gpu device 0000:18:00.0::" in answer.error
    assert not [f for f in os.listdir(node.tmp / "cdi") if f.startswith(DRIVER)]


def test_a_gpu_a_claim_holds_takes_all_its_replicas_out_and_they_are_refused(node: SharedNode) -> None:
    node.api.add("held", CLAIM, [(GPU_POOL, "gpu-0000-2a-00-0")])
    assert prepare(node.driver, ("held", CLAIM)).claims[CLAIM].error == ""
    replicas = ["0000:2a:00.0::0", "0000:2a:00.0::1"]
    assert wait(lambda: all(node.health(r) == "Unhealthy" for r in replicas)), "the kubelet still counts them"
    assert node.health("0000:18:00.0::0") == "Healthy"
    assert node.preferred(["0000:2a:00.0::0", "0000:18:00.0::0"], 1) == ["0000:18:00.0::0"]
    with pytest.raises(grpc.RpcError) as refused:
        node.allocate("0000:2a:00.0::1")
    assert "held by DRA claim" in refused.value.details()
    assert unprepare(node.driver, ("held", CLAIM)).claims[CLAIM].error == ""
    assert wait(lambda: all(node.health(r) == "Healthy" for r in replicas)), "not offered again"
