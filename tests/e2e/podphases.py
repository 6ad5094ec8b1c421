"""Where a pod's start went, phase by phase, from the logs of the cluster cluster-up.sh runs
($KUBE_DIR/logs/kubelet.log at --v=2, containerd.log of the bundled containerd 1.7), for the pods the live
timing tests start (PodClock.created: their POST's time). Phases, in order:

- `claim+schedule`: the POST to the kubelet's `SyncLoop ADD` (the claim made from its template, allocated by
  the scheduler, the pod bound);
- `kubelet sync`: ADD to the kubelet's second "No sandbox" (its pod worker, the volumes mounted);
- `prepare`: that to containerd's `RunPodSandbox` (NodePrepareResources of the pod's claims; a pod with no
  claim shows the kubelet's own ~2 ms);
- `sandbox`: RunPodSandbox (pause container, network);
- `create`: CreateContainer (the OCI spec; containerd 1.7 reads every CDI spec in its dirs and applies the
  named devices' edits here);
- `start`: StartContainer (runc create, the spec's createContainer hooks, runc start);
- `running seen`: from StartContainer's return to the watch's Running event (PLEG, status update, watch)."""

from __future__ import annotations

import datetime
import itertools
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.e2e.conftest import REPO
from tests.e2e.kube import (
    REFERENCE_CLASS,
    KubeClient,
    PodClock,
    ReferenceDriver,
    interleaved,
    one_device_template,
    timed_pod,
)

PHASES = ("claim+schedule", "kubelet sync", "prepare", "sandbox", "create", "start", "running seen")


def _seconds(hms: tuple[str | Any, ...]) -> float:
    return int(hms[0]) * 3600 + int(hms[1]) * 60 + float(hms[2])


def _of_day(wall: float) -> float:
    day = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    return day.hour * 3600 + day.minute * 60 + day.second + day.microsecond / 1e6


def pod_phases(kube_dir: Path, created: dict[str, float], took: dict[str, float]) -> dict[str, dict[str, float]]:
    """name -> phase -> seconds for each pod in `created` (POST time, time.time()) whose phases are all in the
    logs; `took` is each pod's POST-to-Running as PodClock measured it. Times of day (UTC), as the logs have."""
    marks: dict[str, dict[str, float]] = defaultdict(dict)
    second_nosandbox: dict[str, int] = defaultdict(int)
    for line in (kube_dir / "logs" / "kubelet.log").read_text(errors="replace").splitlines():
        found = re.search(r'pods?=\[?"[^/"]+/([^"]+)"', line)
        stamp = re.match(r"[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)", line)
        if not found or not stamp or found[1] not in created:
            continue
        name, at = found[1], _seconds(stamp.groups())
        if '"SyncLoop ADD"' in line:
            marks[name].setdefault("add", at)
        elif "No sandbox for pod can be found" in line:
            second_nosandbox[name] += 1
            if second_nosandbox[name] == 2:
                marks[name]["synced"] = at
    sandboxes: dict[str, str] = {}
    containers: dict[str, str] = {}
    for line in (kube_dir / "logs" / "containerd.log").read_text(errors="replace").splitlines():
        stamp = re.search(r'time="[\d-]+T(\d\d):(\d\d):(\d\d\.\d+)Z"', line)
        if not stamp:
            continue
        at = _seconds(stamp.groups())
        if (found := re.search(r"RunPodSandbox for &PodSandboxMetadata\{Name:([^,]+),", line)) and found[1] in created:
            if (sandbox := re.search(r'returns sandbox id \\"([0-9a-f]+)', line)):
                marks[found[1]]["sandboxed"] = at
                sandboxes[sandbox[1]] = found[1]
            else:
                marks[found[1]].setdefault("sandbox", at)
        elif (found := re.search(r'CreateContainer within sandbox \\"([0-9a-f]+)\\"', line)) and found[1] in sandboxes:
            name = sandboxes[found[1]]
            if (container := re.search(r'returns container id \\"([0-9a-f]+)', line)):
                marks[name]["created"] = at
                containers[container[1]] = name
            else:
                marks[name].setdefault("create", at)
        elif (found := re.search(r'StartContainer for \\"([0-9a-f]+)\\"', line)) and found[1] in containers:
            marks[containers[found[1]]]["started" if "returns successfully" in line else "start"] = at
    out = {}
    order = ("post", "add", "synced", "sandbox", "sandboxed", "create", "created", "start", "started", "running")
    for name, post in created.items():
        got = {**marks.get(name, {}), "post": _of_day(post), "running": _of_day(post) + took.get(name, 0.0)}
        if name not in took or not all(key in got for key in order):
            continue
        spans = [got[b] - got[a] for a, b in itertools.pairwise(order)]
        # post->add, add->synced, synced->sandbox, sandbox (run), sandboxed->create (kept in `sandbox`), create,
        # created->start (kept in `create`), start, started->running
        out[name] = {"claim+schedule": spans[0], "kubelet sync": spans[1], "prepare": spans[2],
                     "sandbox": spans[3] + spans[4], "create": spans[5] + spans[6], "start": spans[7],
                     "running seen": spans[8]}
    return out


def median_phases(phases: dict[str, dict[str, float]], names: list[str]) -> dict[str, float]:
    """Each phase's median (ms, one decimal) over the pods `names` (those the logs had)."""
    rows = [phases[n] for n in names if n in phases]
    return {p: round(statistics.median(r[p] for r in rows) * 1000, 1) for p in PHASES} if rows else {}


def table(columns: dict[str, dict[str, float]]) -> str:
    """The phases (ms) as a text table, one column per variant."""
    head = f"{'phase':16s}" + "".join(f"{c:>14s}" for c in columns)
    lines = [head] + [f"{p:16s}" + "".join(f"{columns[c].get(p, float('nan')):14.1f}" for c in columns)
                      for p in PHASES]
    return "\n".join(lines)


FIGURES = REPO / "build" / "dra-figures.json"


def record(name: str, value: object) -> None:
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    figures[name] = value
    FIGURES.parent.mkdir(exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


def summarized(kube_dir: Path, clock: PodClock, taken: dict[str, dict[str, float]], label: str) \
        -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """An interleaved run's medians (variant -> seconds), phase columns (variant -> phase -> ms) and each pod's
    phases from the cluster's logs, the medians and the table printed under `label`."""
    medians = {v: statistics.median(t.values()) for v, t in taken.items()}
    took = {name: seconds for t in taken.values() for name, seconds in t.items()}
    phases = pod_phases(kube_dir, clock.created, took)
    columns = {v: median_phases(phases, list(t)) for v, t in taken.items()}
    print(f"{label}: POST to Running, median of {ROUNDS}: " + ", ".join(f"{v} {m:.3f} s" for v, m in medians.items()))
    print(table(columns))
    return medians, columns, phases


ROUNDS = 9  # pods per variant, interleaved: the median of 9 (the issue asks for at least 5)
DRIVER_LOG = "devinject-dra-driver.log"
PREPARED = re.compile(r"prepared claim default/(\S+) \(\S+\) in ([0-9.]+) ms, ([0-9.]+) of them reading it: ")


def driver_prepares(log: Path, pods: list[str]) -> dict[str, tuple[float, float]]:
    """Each pod's claim as devinject's driver logged its prepare: pod -> (ms in the driver, ms of them the
    claim's read). A claim made from a pod's template is named `<pod>-<claim>-<suffix>`."""
    found: dict[str, tuple[float, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = PREPARED.search(line)
        if match is None:
            continue
        for pod in pods:
            if match[1].startswith(f"{pod}-"):
                found[pod] = (float(match[2]), float(match[3]))
    return found


def race_the_reference(cluster: KubeClient, node: str, device_class: str, prefix: str) -> tuple[float, float]:
    """A one-device pod through `device_class` (devinject's driver) against the same pod with Kubernetes' own
    dra-test-driver, and a pod with no claim, ROUNDS each interleaved, POST to Running through the API
    (PodClock); the medians and the phase table from the cluster's logs recorded under `prefix`. Answers
    (ours, the reference's) medians."""
    reference = ReferenceDriver(cluster, node)
    try:
        clock = PodClock(cluster.kube_dir)

        def claimed(device: str) -> Any:
            def make(name: str) -> dict[str, Any]:
                cluster.apply(one_device_template(name, device))
                return timed_pod(name, claim_template=name)
            return make

        taken = interleaved(cluster, clock, {"ours": claimed(device_class), "reference": claimed(REFERENCE_CLASS),
                                             "plain": timed_pod}, ROUNDS, prefix.replace("_", "-"))
    finally:
        reference.stop()
    medians, columns, phases = summarized(cluster.kube_dir, clock, taken, prefix)
    took = {name: seconds for t in taken.values() for name, seconds in t.items()}
    record(f"{prefix}_devinject_s", round(medians["ours"], 3))
    record(f"{prefix}_reference_s", round(medians["reference"], 3))
    record(f"{prefix}_plain_s", round(medians["plain"], 3))
    record(f"{prefix}_ratio", round(medians["ours"] / medians["reference"], 3))
    record(f"{prefix}_phases_ms", columns)
    assert all(len(phases.get(n, {})) == len(PHASES) for n in took), f"phases missing from the logs: {sorted(took)}"
    # the prepare phase's part inside devinject's driver, and of that the claim's read, from the driver's log
    prepares = driver_prepares(cluster.kube_dir / "logs" / DRIVER_LOG, list(taken["ours"]))
    assert sorted(prepares) == sorted(taken["ours"]), f"prepares missing from {DRIVER_LOG}: {sorted(prepares)}"
    inside = round(statistics.median(ms for ms, _ in prepares.values()), 1)
    reading = round(statistics.median(read for _, read in prepares.values()), 1)
    print(f"{prefix}: devinject's prepare inside the driver, median {inside} ms, the claim's read {reading} ms")
    record(f"{prefix}_driver_prepare_ms", inside)
    record(f"{prefix}_driver_claim_read_ms", reading)
    return medians["ours"], medians["reference"]
