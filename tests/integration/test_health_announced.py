"""A fault the kernel announces reaches the kubelet's list between the agent's rounds: the device plugin with
an interval and recheck of 60 s, against the kubelet's side of the API over real unix sockets
(fake_kubelet.py). The waits are bounded only so a broken agent fails; nothing asserts a duration (the
figures: bench/bench_health_latency.py)."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions
from devinject.specs.generate import GenerateOptions
from tests.integration.fake_kubelet import FakeKubelet

GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"


class Node:
    def __init__(self, root: Path, work: Path, plugin_dir: Path) -> None:
        self.root = root
        (root / "var/log").mkdir(parents=True, exist_ok=True)
        (root / "var/log/kern.log").write_text("Jan  1 00:00:00 node kernel: boot\n")
        gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=("nvidia.com/gpu",))
        watch = WatchOptions(generate=gen, output_dir=work / "cdi", state_dir=str(work / "state"), interval=60,
                             recheck=60, threshold=3, rescan=3600, uevents=False, probe_timeout=1.0)
        self.kubelet = FakeKubelet(str(plugin_dir))
        self.kubelet.start()
        self.agent = DevicePluginAgent(PluginOptions(watch=watch, plugin_dir=str(plugin_dir), kubelet_poll=0.2))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def health(self, address: str) -> str | None:
        return (self.kubelet.latest("nvidia.com/gpu") or {}).get(address, (None,))[0]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.kubelet.stop()


@pytest.fixture
def node(host_copy, tmp_path) -> Iterator[Node]:  # type: ignore[no-untyped-def]
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # a unix socket path has <= 107 bytes
    running = Node(host_copy("hgx-h100"), tmp_path, plugin_dir)
    try:
        assert running.kubelet.wait_for(lambda: running.health("0000:18:00.0") == "Healthy"), "never registered"
        yield running
    finally:
        running.close()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def test_an_xid_line_reaches_the_kubelet_without_waiting_for_the_interval(node: Node) -> None:
    with open(node.root / "var/log/kern.log", "a") as handle:
        handle.write("Jan  1 00:00:01 node kernel: [ 42.1] NVRM: Xid (PCI:0000:18:00): 79, pid=0, "
                     "GPU has fallen off the bus.\n")
    assert node.kubelet.wait_for(lambda: node.health("0000:18:00.0") == "Unhealthy", timeout=10)
    assert node.health("0000:2a:00.0") == "Healthy"


def test_an_unbind_uevent_reaches_the_kubelet_without_waiting_for_the_interval(node: Node) -> None:
    (node.root / GPU / "driver").unlink()
    node.agent.watcher.uevent({"ACTION": "unbind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:18:00.0",
                               "DEVPATH": "/" + GPU.removeprefix("sys/")})
    assert node.kubelet.wait_for(lambda: node.health("0000:18:00.0") in ("Unhealthy", None), timeout=10)
    assert node.health("0000:2a:00.0") == "Healthy"
