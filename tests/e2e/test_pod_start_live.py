"""How long a GPU pod takes to start on the real one-node cluster (../shared/kube/cluster-up.sh with
CONTAINERD=bundled: containerd 1.7.34 applies CDI) when devinject's specs name their CDI hook: the HGX H100
fixture host (tests/fixtures/build_hosts.py, real char nodes) has the driver's libraries, so a GPU's spec has
17 mounts and one `cdi-hook links-and-ldcache` (25 links, the linker cache), which containerd's runc runs at
every container start (test_dra_live.py's host has no libraries: its specs name no hook).

- DRA: a pod with a one-GPU claim of `devinject dra-driver` (default timings, a DRA-only node) against the
  same pod with Kubernetes' own dra-test-driver (env edits only) and a pod with no claim, interleaved; then
  again with `devinject hook-server` on the node, the hook handed to it (its log counts what it served).
- Device plugin: `devinject device-plugin --allocate cdi` (Allocate answers CDI names only, containerd applies
  them) on the same host: a pod with `nvidia.com/gpu: 1` against the same pod with no device, interleaved.

Each pod's POST to Running is timed through the API (kube.PodClock), and its phases read from the kubelet's
and containerd's logs (podphases.py); the figures go to build/dra-figures.json. Before the timing, one pod of
each kind is checked to get its GPU and the hook's work (the GPU's node, a link the hook makes, the library
folder in the linker cache), so the time measured is that of a start that did it. No timed assertion.

A missing prerequisite fails, never skips. The cluster is always taken down (`cluster-down.sh --purge`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devinject.core.paths import HOOK_SOCKET
from tests.e2e.conftest import DEVINJECT, REPO, terminate
from tests.e2e.kube import KUBE, KubeClient, PodClock, interleaved, need, one_device_template, timed_pod, until
from tests.e2e.podphases import ROUNDS, race_the_reference, record, summarized
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live

KUBE_DIR = Path("/tmp/devinject-podstart-test")
HOST = Path("/var/lib/devinject-podstart-test/host")
STATE = Path("/run/devinject-podstart-test")
CDI = Path("/var/run/cdi")
DRIVER = "dra.devinject.io"
GPU_CLASS = "gpu.devinject.io"
# what the hook makes in the container: a link of the spec's `--link`s, the linker cache naming the folder
HOOK_CHECK = ("ls /dev | grep -cE '^nvidia[0-9]+$'; readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1; "
              "grep -c libcuda.so.1 /etc/ld.so.cache")


class Node(KubeClient):
    def __init__(self) -> None:
        super().__init__(KUBE_DIR, "bundled")
        self.node = ""
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        with open(KUBE_DIR / "logs" / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def stop(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            terminate(process)

    def hook_work(self, pod: dict[str, Any]) -> list[str]:
        """What the pod's container sees of its GPU and the hook's work (HOOK_CHECK), the pod removed after."""
        name = pod["metadata"]["name"]
        self.apply(pod)
        try:
            until(lambda: self.json("pod", name)["status"].get("phase") == "Running", 120, f"pod {name} Running")
            return self.kubectl("exec", name, "--", "sh", "-c", HOOK_CHECK, check=False).split()
        finally:
            self.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true", timeout=120)
            self.kubectl("delete", "resourceclaimtemplate", name, "--ignore-not-found", timeout=60)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    need(os.geteuid() == 0, "needs root")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh")
    shutil.rmtree(HOST.parent, ignore_errors=True)
    builder = LibBuilder()
    try:
        host = FakeHost(HOST, real_nodes=True)
        build_hgx_h100(builder, host)
        host.finish(ldconfig=False)
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    (HOST / "var/log").mkdir(parents=True, exist_ok=True)
    (HOST / "var/log/kern.log").write_text("kernel: Linux version 6.1.0\n")
    for directory in (HOST.parent, HOST):
        directory.chmod(0o755)
    running = Node()
    try:
        up = subprocess.run([str(KUBE / "cluster-up.sh")], capture_output=True, text=True, env=running.env,
                            timeout=600)
        assert up.returncode == 0, f"cluster-up.sh failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        running.node = running.json("nodes")["items"][0]["metadata"]["name"]
        yield running
    finally:
        for name in list(running.processes):
            running.stop(name)
        kept = REPO / "build" / "podstart-logs"  # the run's logs, for its phases (--purge removes them)
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(KUBE_DIR / "logs", kept, dirs_exist_ok=True)
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=running.env,
                       timeout=300)
        shutil.rmtree(HOST.parent, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def test_a_dra_pod_whose_spec_names_the_hook_against_the_reference_driver(node: Node) -> None:
    node.start("devinject-dra-driver", [
        DEVINJECT, "dra-driver", "--host-root", str(HOST), "--node-name", node.node, "--kubeconfig",
        str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(STATE / "dra"), "--hook-path", DEVINJECT,
        "--health", "check", "--no-uevents", "--metrics-address", ""])
    try:
        until(lambda: node.json("resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"], 60,
              "the driver's ResourceSlices")
        gpus = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].kind == "nvidia.com/gpu"'
        node.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": GPU_CLASS},
                    "spec": {"selectors": [{"cel": {"expression": gpus}}]}})
        node.apply(one_device_template("check", GPU_CLASS))
        seen = node.hook_work(timed_pod("check", claim_template="check"))
        assert seen[:1] == ["1"] and seen[1:2] == ["libcuda.so.550.54.14"] and seen[2:] != ["0"], seen
        race_the_reference(node, node.node, GPU_CLASS, "pod_running_hooks")
        # The same race with the spec's hook handed to a hook server on the node (its default socket, where
        # the hook looks): what the served path saves a pod start in the cluster, not on an idle runc.
        node.start("devinject-hook-server", [DEVINJECT, "-v", "hook-server"])
        until(lambda: Path(HOOK_SOCKET).exists(), 30, f"the hook server's socket {HOOK_SOCKET}")
        race_the_reference(node, node.node, GPU_CLASS, "pod_running_hooks_served")
        served = (KUBE_DIR / "logs" / "devinject-hook-server.log").read_text().count("cdi-hook served for pid")
        assert served >= ROUNDS, f"{served} cdi-hooks served for {ROUNDS} pods: the pods' hooks ran in-process"
    finally:
        node.stop("devinject-hook-server")
        node.stop("devinject-dra-driver")


def test_a_device_plugin_pod_on_containerd_17_against_the_same_pod_without_devices(node: Node) -> None:
    """The kubelet's device-plugin path: Allocate answers the GPU's CDI name (`--allocate cdi`), containerd
    1.7 reads the spec from /var/run/cdi and applies it, runc runs the spec's hook."""
    node.start("devinject-device-plugin", [
        DEVINJECT, "device-plugin", "--host-root", str(HOST), "--output-dir", str(CDI), "--state-dir",
        str(STATE / "plugin"), "--kind", "nvidia.com/gpu", "--allocate", "cdi", "--no-uevents",
        "--metrics-address", "", "--hook-path", DEVINJECT])
    try:
        until(lambda: node.json("node", node.node)["status"].get("allocatable", {}).get("nvidia.com/gpu") == "8",
              60, "8 nvidia.com/gpu allocatable")
        seen = node.hook_work(timed_pod("check", limits={"nvidia.com/gpu": 1}))
        assert seen[:1] == ["1"] and seen[1:2] == ["libcuda.so.550.54.14"] and seen[2:] != ["0"], seen
        specs = sorted(p.name for p in CDI.iterdir())
        clock = PodClock(KUBE_DIR)
        taken = interleaved(node, clock, {"plugin": lambda name: timed_pod(name, limits={"nvidia.com/gpu": 1}),
                                          "plain": timed_pod}, ROUNDS, "plugin")
    finally:
        node.stop("devinject-device-plugin")
    medians, columns, phases = summarized(KUBE_DIR, clock, taken, f"device plugin (CDI specs: {specs})")
    took = {name: seconds for t in taken.values() for name, seconds in t.items()}
    record("pod_running_plugin_s", round(medians["plugin"], 3))
    record("pod_running_plugin_plain_s", round(medians["plain"], 3))
    record("pod_running_plugin_over_plain_ms", round((medians["plugin"] - medians["plain"]) * 1000, 1))
    record("pod_running_plugin_phases_ms", columns)
    assert len(phases) == len(took), f"phases missing from the logs: {sorted(set(took) - set(phases))}"
