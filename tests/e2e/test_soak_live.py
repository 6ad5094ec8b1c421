"""A soak on the real one-node cluster (CONTAINERD=bundled: containerd 1.7 applies CDI), the device plugin's
DaemonSet and `devinject dra-driver` sharing one state dir (test_both_paths_live.py's node): pods created and
deleted, gracefully and with `--force --grace-period=0`, in a mix of DRA claims and device-plugin pods, while
in turn the device plugin and the driver are SIGKILLed, ledger.json is corrupted, a fatal Xid hits a GPU a
claim holds and `devinject put-back` returns it, and every live pod is force-deleted at once.

Throughout, what every running container sees (its /dev/nvidiaN char nodes, by major:minor) is sampled; at
the end: no GPU was ever in two running pods at one sample, every pod the node had room for was Running
within POD_BOUND_S, capacity is back (the slices' GPUs and the node's allocatable are the node's eight, no
taint), nothing leaked (no claim spec in /var/run/cdi, `devinject list` all free and healthy), one claim
and then one device-plugin pod get the whole node, and neither agent logged a Traceback. Bounded by count
(PHASES x STEPS) and by time (BUDGET_S). Figures to build/soak-figures.json.

A missing prerequisite fails, never skips. The cluster is always taken down (the node fixture)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO
from tests.e2e.kube import until
from tests.e2e.test_both_paths_live import (
    CLASS,
    DEVINJECT,
    DRIVER,
    HOST,
    STATE,
    Node,
    node,  # noqa: F401 - the module fixture: the cluster with both agents on its node
)
from tests.e2e.test_cluster_live import (
    BUSYBOX,
    GPU,
    SLEEPER,
    image,  # noqa: F401 - the module fixture: `make image`
)

pytestmark = pytest.mark.live

CDI = Path("/var/run/cdi")
FIGURES = REPO / "build" / "soak-figures.json"
POD_BOUND_S = 90
BUDGET_S = 180  # the churn's own wall clock; the cluster's start and the final checks come on top
ROUNDS = 2  # every fault in turn, twice within the budget
FAULTS = ("sigkill-device-plugin", "sigkill-dra-driver", "corrupt-ledger", "xid-then-put-back", "force-delete-all")
LIVE = 6  # pods kept alive: the node has 8 GPUs, one may be out for the Xid


class Soak:
    def __init__(self, cluster: Node) -> None:
        self.node = cluster
        self.serial = 0
        self.live: list[str] = []
        self.to_running: dict[str, float] = {}
        self.no_room: list[str] = []
        self.samples = 0
        self.problems: list[str] = []
        self.faults: dict[str, int] = {}
        self.deletes = {"graceful": 0, "forced": 0}

    # --- churn ------------------------------------------------------------------------------------------
    def create(self) -> str:
        self.serial += 1
        path = "claim" if self.serial % 2 else "plugin"
        name = f"{'dra' if path == 'claim' else 'dp'}-{self.serial}"
        start = time.monotonic()
        (self.node.claim_pod if path == "claim" else self.node.plugin_pod)(name)
        self.live.append(name)

        def settled() -> str | None:
            pod = self.node.phases().get(name)
            if pod is None:
                return None
            status = pod["status"]
            if status.get("phase") == "Running" and all(c.get("ready") for c in status.get("containerStatuses", [])):
                return "running"
            unscheduled = [c for c in status.get("conditions", []) if c["type"] == "PodScheduled"
                           and c["status"] == "False" and ("Insufficient" in c.get("message", "")
                                                            or "cannot allocate" in c.get("message", ""))]
            return "no-room" if unscheduled and time.monotonic() - start > 10 else None

        try:
            how = until(settled, POD_BOUND_S, f"pod {name} Running", every=0.3)
        except AssertionError as err:
            raise AssertionError(f"{err}; {self.node.diagnosis()}") from None
        if how == "running":
            self.to_running[name] = round(time.monotonic() - start, 2)
        else:
            self.no_room.append(name)
        self.sample()
        return name

    def delete(self, name: str, forced: bool) -> None:
        if forced:
            self.node.kubectl("delete", "pod", name, "--force", "--grace-period=0", "--wait=false", timeout=60)
        else:
            self.node.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true", timeout=120)
        self.node.kubectl("delete", "resourceclaimtemplate", name, "--ignore-not-found", "--wait=false", timeout=60)
        self.deletes["forced" if forced else "graceful"] += 1
        self.live.remove(name)
        self.node.created.remove(name)
        self.sample()

    def sample(self) -> None:
        """What each running container sees now; a GPU in two of them is recorded (asserted at the end)."""
        self.samples += 1
        owners: dict[tuple[int, ...], str] = {}
        for name, pod in self.node.phases().items():
            if pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
                continue
            done = subprocess.run(
                [str(self.node.kube_dir / "bin" / "kubectl"), "exec", name, "--", "sh", "-c",
                 'for f in /dev/nvidia[0-9]*; do [ -e "$f" ] && stat -c "%t %T" "$f"; done; true'],
                capture_output=True, text=True, env=self.node.env, timeout=30)
            if done.returncode != 0:
                continue  # ended between the list and the exec
            seen = [tuple(int(n, 16) for n in line.split()) for line in done.stdout.splitlines()]
            if len(seen) != 1:  # every churn pod asks for one GPU
                self.problems.append(f"sample {self.samples}: {name} sees {seen}")
            for gpu in seen:
                if gpu in owners:
                    self.problems.append(f"sample {self.samples}: GPU {gpu} in {owners[gpu]} and {name}")
                owners[gpu] = name

    def churn(self, steps: int, deadline: float) -> None:
        for step in range(steps):
            if time.monotonic() > deadline:
                return
            while len(self.live) < LIVE:
                self.create()
            self.delete(self.live[0], forced=step % 2 == 1)
            self.create()

    # --- faults -----------------------------------------------------------------------------------------
    def inject(self, fault: str) -> None:
        self.faults[fault] = self.faults.get(fault, 0) + 1
        getattr(self, fault.replace("-", "_"))()
        self.sample()

    def sigkill_device_plugin(self) -> None:
        agent = self.node.agent()
        assert agent is not None
        restarts = restart_count(agent)
        pids = device_plugin_pids()
        assert pids, "no device-plugin process on the host"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        until(lambda: (a := self.node.agent()) is not None and restart_count(a) > restarts, 120,
              "the device plugin's container restarted and Ready")

    def sigkill_dra_driver(self) -> None:
        self.node.stop_driver(signal.SIGKILL)
        self.node.start_driver()

    def corrupt_ledger(self) -> None:
        (STATE / "ledger.json").write_text('{"allocations": {"c1": {"exclus')

    def xid_then_put_back(self) -> None:
        while not [n for n in self.live if n.startswith("dra-") and n not in self.no_room]:
            self.create()  # the paths alternate: a claim's pod within two
        claim = next(n for n in self.live if n.startswith("dra-") and n not in self.no_room)
        pod = self.node.json("pod", claim)
        (entry,) = pod["status"]["resourceClaimStatuses"]
        (result,) = self.node.json("resourceclaim", entry["resourceClaimName"])["status"]["allocation"]["devices"][
            "results"]
        device = result["device"]  # gpu-0000-18-00-0
        address = "{}:{}:{}.{}".format(*device.removeprefix("gpu-").split("-"))
        with (HOST / "var" / "log" / "kern.log").open("a") as log:
            log.write(f"[ 4242.424242] NVRM: Xid (PCI:{address[:-2]}): 79, pid=0, GPU has fallen off the bus.\n")
        until(lambda: any(t["key"] == f"{DRIVER}/xid" for t in self.taints().get(device, [])), 60,
              f"{device} tainted xid in the slice")
        self.churn(1, time.monotonic() + 60)  # a pod placed while the GPU is out: never on it
        done = subprocess.run([DEVINJECT, "put-back", f"{GPU}={address}", "--root", str(HOST), "--state-dir",
                               str(STATE)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        until(lambda: not self.taints().get(device), 60, f"{device}'s taint cleared by put-back")

    def force_delete_all(self) -> None:
        for name in list(self.live):
            self.delete(name, forced=True)

    def taints(self) -> dict[str, list[dict[str, Any]]]:
        items = self.node.json("resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
        return {d["name"]: d.get("taints", []) for s in items for d in s["spec"].get("devices", [])}


def restart_count(agent: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in agent["status"].get("containerStatuses", [])
               if c["name"] == "device-plugin")


def device_plugin_pids() -> list[int]:
    """The device plugin's process on the host (the DaemonSet's container), by its command line."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"device-plugin" in args and any(a.startswith(b"--plugin-dir") for a in args):
            found.append(int(cmdline.parent.name))
    return found


def whole_node(cluster: Node, name: str, path: str) -> None:
    """One pod with all eight GPUs, by one path; Running within the bound, seeing eight GPUs; deleted."""
    if path == "claim":
        cluster.apply(
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
             "spec": {"spec": {"devices": {"requests": [
                 {"name": "gpu", "exactly": {"deviceClassName": CLASS, "count": 8}}]}}}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"test": "both"}},
             "spec": {"terminationGracePeriodSeconds": 1,
                      "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
                      "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                      "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}})
    else:
        cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"test": "both"}},
                    "spec": {"terminationGracePeriodSeconds": 1, "containers": [
                        {"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never", "command": SLEEPER,
                         "resources": {"limits": {GPU: 8}}}]}})
    cluster.created.append(name)
    cluster.running(name, timeout=POD_BOUND_S)
    seen = cluster.seen()[name]
    assert len(seen) == 8, f"{name} sees {seen}"
    cluster.delete(name)


def agent_logs(cluster: Node) -> str:
    agent = cluster.agent()
    assert agent is not None
    name = agent["metadata"]["name"]
    return "".join(cluster.kubectl("-n", "devinject-system", "logs", name, "-c", "device-plugin", *extra, check=False)
                   for extra in ((), ("--previous",)))


def test_soak(node: Node) -> None:  # noqa: F811 - the imported fixture
    soak = Soak(node)
    started = time.monotonic()
    deadline = started + BUDGET_S
    try:
        for round_ in range(ROUNDS):
            for fault in FAULTS:
                if round_ and time.monotonic() > deadline:
                    break  # every fault once whatever the time; again only within the budget
                soak.churn(2, deadline)
                soak.inject(fault)
                soak.churn(2, deadline)
        churn_s = round(time.monotonic() - started, 1)
        for name in list(soak.live):
            soak.delete(name, forced=False)
        back = time.monotonic()

        def capacity() -> bool:
            taints = soak.taints()
            return len(taints) >= 8 and len([n for n in taints if n.startswith("gpu-")]) == 8 \
                and not any(taints.values()) and node.allocatable() == 8

        until(capacity, 120, "the slices' 8 GPUs untainted and allocatable 8")
        capacity_back_s = round(time.monotonic() - back, 2)

        def all_free() -> list[dict[str, Any]] | None:
            done = subprocess.run([DEVINJECT, "list", "--json", "--kind", GPU, "--root", str(HOST), "--state-dir",
                                   str(STATE)], capture_output=True, text=True, timeout=60)
            rows = json.loads(done.stdout) if done.returncode == 0 else []
            return rows if len(rows) == 8 and all(r["health"] == "healthy" and not r["holders"] for r in rows) \
                else None

        try:
            until(all_free, 60, "`devinject list` all eight GPUs free and healthy", every=1)
        except AssertionError as err:
            listed = subprocess.run([DEVINJECT, "list", "--root", str(HOST), "--state-dir", str(STATE)],
                                    capture_output=True, text=True, timeout=60)
            raise AssertionError(f"{err}:\n{listed.stdout}{listed.stderr}") from None
        until(lambda: not list(CDI.glob(f"{DRIVER}-*.json")), 60, "no claim spec left in /var/run/cdi")
        whole_node(node, "whole-claim", "claim")
        until(capacity, 120, "capacity back after the whole-node claim")
        whole_node(node, "whole-plugin", "plugin")
        until(capacity, 120, "capacity back after the whole-node device-plugin pod")
        figures = {
            "pods_run": len(soak.to_running), "pods_no_room": len(soak.no_room), "faults_injected": soak.faults,
            "deletes": soak.deletes, "samples": soak.samples, "sample_problems": len(soak.problems),
            "max_pod_to_running_s": max(soak.to_running.values()),
            "median_pod_to_running_s": sorted(soak.to_running.values())[len(soak.to_running) // 2],
            "capacity_back_s": capacity_back_s, "churn_s": churn_s,
            "soak_s": round(time.monotonic() - started, 1)}
        print(f"\nsoak figures: {json.dumps(figures, sort_keys=True)}")
        FIGURES.parent.mkdir(exist_ok=True)
        FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        assert not soak.problems, "what the containers saw: " + "; ".join(soak.problems[:10])
        assert set(soak.faults) == set(FAULTS), f"faults not all injected within the budget: {soak.faults}"
        assert "Traceback" not in node.log.read_text(errors="replace"), "the DRA driver logged a Traceback"
        logs = agent_logs(node)
        assert "Traceback" not in logs, "the device plugin logged a Traceback"
        # the driver's `--health auto` takes the loop over while the plugin is down: one loop per state dir
        # still once the plugin is back
        assert "another health loop runs" not in logs, "two health loops on one state dir after a restart"
    finally:
        for name in list(node.created):
            node.kubectl("delete", "pod", name, "--force", "--grace-period=0", "--ignore-not-found", check=False)
            node.kubectl("delete", "resourceclaimtemplate", name, "--ignore-not-found", check=False)
            node.created.remove(name)
