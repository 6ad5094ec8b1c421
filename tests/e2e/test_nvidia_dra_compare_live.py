"""devinject's DRA driver beside NVIDIA's own (gpu-kubelet-plugin v0.4.1, ../shared/peers) on one real
cluster (../shared/kube/cluster-up.sh, CONTAINERD=bundled: containerd 1.7 applies CDI), both over the same
fake HGX H100 node (real char nodes, real ELF libraries) whose libnvidia-ml is the stub built from the
fixture's data (tests/nvmlstub).

Both slices are read back from the API server and compared GPU by GPU (matched by `uuid`): every attribute
and capacity that both publish must have the same type (string, int, bool, version) and value, and a name
one publishes and the other lacks is a difference too. The test fails on any difference that
docs/dra.md's "Against NVIDIA's DRA driver" table does not list, with its reason, and on a listed one that
no longer occurs (the table stays true). Then a one-GPU claim through each driver's DeviceClass runs its pod
on the node.

NVIDIA's plugin reads the standard `pcieRoot` from the real `/sys` whatever its driver root, and its CDI
generation reads `/proc/driver/nvidia-caps` of the machine: it runs in a mount namespace of its own with
the host tree's `sys` over `/sys` and `proc/driver` over `/proc/driver`, so stopping it ends the namespace.

Run it under the cluster lock: `flock /tmp/devinject-kube.lock .venv/bin/pytest -q
tests/e2e/test_nvidia_dra_compare_live.py`. A missing prerequisite fails, never skips; the plugins, their
sockets and checkpoints in the kubelet's dirs, their claim specs and the cluster are always removed."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from tests.e2e.conftest import REPO, terminate
from tests.e2e.kube import KUBE, KubeClient, need, until
from tests.e2e.peers import unpacked
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live

KUBE_DIR = Path("/tmp/devinject-nvcompare-test")
BASE = Path("/var/lib/devinject-nvcompare-test")
HOST = BASE / "host"
STATE = Path("/run/devinject-nvcompare-test")
DOCS = REPO / "docs" / "dra.md"
SECTION = "## Against NVIDIA's DRA driver"
CDI = Path("/var/run/cdi")
PLUGINS = Path("/var/lib/kubelet/plugins")
REGISTRY = Path("/var/lib/kubelet/plugins_registry")
DEVINJECT = str(Path(sys.executable).parent / "devinject")
OURS, THEIRS = "dra.devinject.io", "gpu.nvidia.com"
CLASSES = {OURS: "gpu.devinject.io", THEIRS: "gpu.nvidia.com"}
SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; sleep 3600 & wait']
ONLY_IN = {OURS: "only devinject", THEIRS: "only NVIDIA"}


def gpu_class(driver: str) -> str:
    """The selector of NVIDIA's own DeviceClass `gpu.nvidia.com` (its Helm chart's), in `driver`'s domain: one
    written for NVIDIA's driver selects devinject's GPUs unchanged."""
    return f"device.driver == '{driver}' && device.attributes['{driver}'].type == 'gpu'"


class Cluster(KubeClient):
    def __init__(self) -> None:
        super().__init__(KUBE_DIR, "bundled")
        self.node = ""
        self.processes: list[subprocess.Popen[bytes]] = []

    def log(self, name: str) -> BinaryIO:
        return open(KUBE_DIR / "logs" / name, "ab")

    def published_gpus(self, count: int) -> None:
        """Both drivers' `count` GPUs in their slices; else the failure with the drivers' logs' ends
        (cluster-down.sh --purge wipes the logs)."""
        try:
            for driver in CLASSES:
                until(lambda d=driver: len(self.gpus(d)) == count, 90,  # type: ignore[misc]
                      f"{driver}'s {count} GPUs in its slices")
        except AssertionError as err:
            logs = {name: (KUBE_DIR / "logs" / name).read_bytes()[-2000:].decode(errors="replace")
                    for name in ("devinject-dra-nvcompare.log", "gpu-kubelet-plugin.log")}
            raise AssertionError(f"{err}\n" + "\n".join(f"--- {n}:\n{t}" for n, t in logs.items())) from None

    def start_devinject(self) -> None:
        with self.log("devinject-dra-nvcompare.log") as log:
            self.processes.append(subprocess.Popen(
                [DEVINJECT, "dra-driver", "--host-root", str(HOST), "--nvml", "--node-name", self.node,
                 "--kubeconfig", str(KUBE_DIR / "admin.kubeconfig"), "--state-dir", str(STATE), "--hook-path",
                 DEVINJECT, "--kind", "nvidia.com/gpu", "--rescan", "30", "--metrics-address", "127.0.0.1:0",
                 "--no-uevents"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL))

    def start_nvidia(self, plugin: Path, hook: Path) -> None:
        """NVIDIA's plugin as its README says it ran here: the host tree as both driver roots, specs in
        /var/run/cdi, its hooks the peers' nvidia-cdi-hook, the kubelet's own plugin dirs."""
        command = [str(plugin), "--node-name", self.node, "--kubeconfig", str(KUBE_DIR / "admin.kubeconfig"),
                   "--nvidia-driver-root", str(HOST), "--container-driver-root", str(HOST), "--cdi-root", str(CDI),
                   "--nvidia-cdi-hook-path", str(hook), "--kubelet-plugins-directory-path", str(PLUGINS),
                   "--kubelet-registrar-directory-path", str(REGISTRY), "--image-name", "localhost/unused:1", "-v", "4"]
        script = (f"mount --bind {HOST}/sys /sys && mount --bind {HOST}/proc/driver /proc/driver && exec "
                  + " ".join(command))
        with self.log("gpu-kubelet-plugin.log") as log:
            self.processes.append(subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                                                   stdout=log, stderr=log, stdin=subprocess.DEVNULL))

    def stop(self) -> None:
        for process in self.processes:
            terminate(process)
        self.processes = []

    def gpus(self, driver: str) -> dict[str, dict[str, Any]]:
        """The driver's GPUs in its slices for the node, by uuid."""
        slices = self.json("resourceslices", "--field-selector", f"spec.driver={driver}")["items"]
        devices = [d for s in slices if s["spec"].get("nodeName") == self.node for d in s["spec"].get("devices", [])]
        return {d["attributes"]["uuid"]["string"]: d for d in devices if "uuid" in d.get("attributes", {})}

    def pod(self, name: str) -> dict[str, Any]:
        return self.json("pod", name)  # type: ignore[no-any-return]


def leftovers() -> list[str]:
    """What either driver would leave in the kubelet's dirs and the CDI dir (its sockets, NVIDIA's checkpoint,
    claim specs) where cluster-down.sh did not wipe them."""
    paths = [PLUGINS / THEIRS, *REGISTRY.glob(f"{THEIRS}*"), *CDI.glob("k8s.gpu.nvidia.com*"),
             *CDI.glob(f"{THEIRS}*"), *CDI.glob(f"{OURS}-*")]
    return [str(p) for p in paths if p.exists()]


@pytest.fixture(scope="module")
def cluster(nvml_stubs) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    from tests.nvmlstub import install_stub

    need(os.geteuid() == 0, "needs root")
    need((KUBE / "cluster-up.sh").exists(), f"{KUBE}/cluster-up.sh")
    need(shutil.which("unshare") is not None, "unshare (util-linux)")
    shutil.rmtree(BASE, ignore_errors=True)
    with contextlib.ExitStack() as scratch:
        builder = LibBuilder()
        scratch.callback(shutil.rmtree, builder.tmp, ignore_errors=True)
        build_hgx_h100(builder, FakeHost(HOST, real_nodes=True))
    install_stub(HOST, nvml_stubs("hgx-h100"))
    (BASE / "bin").mkdir()
    plugin, hook = unpacked("gpu-kubelet-plugin", BASE / "bin"), unpacked("nvidia-cdi-hook", BASE / "bin")
    for directory in (BASE, HOST, BASE / "bin"):
        directory.chmod(0o755)
    cluster = Cluster()
    try:
        cluster.node = cluster.up()
        (KUBE_DIR / "logs").mkdir(parents=True, exist_ok=True)
        cluster.apply(*[{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                         "spec": {"selectors": [{"cel": {"expression": gpu_class(driver)}}]}}
                        for driver, name in CLASSES.items()])
        cluster.start_devinject()
        cluster.start_nvidia(plugin, hook)
        cluster.published_gpus(8)
        yield cluster
    finally:
        cluster.stop()
        subprocess.run([str(KUBE / "cluster-down.sh"), "--purge"], capture_output=True, env=cluster.env,
                       timeout=300)
        for path in leftovers():
            shutil.rmtree(path) if Path(path).is_dir() else Path(path).unlink()
        shutil.rmtree(BASE, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def compared(name: str, driver: str) -> str:
    """An attribute's name as both drivers' selectors read it: the driver's own domain left off."""
    return name.removeprefix(f"{driver}/")


def published(device: dict[str, Any], driver: str) -> dict[str, tuple[str, str]]:
    """A device's attributes and capacities: name -> (type, value); a capacity's type is `quantity` (the API
    server stores it in its canonical form, so equal quantities read back equal)."""
    out = {compared(n, driver): (kind, str(value)) for n, a in device.get("attributes", {}).items()
           for kind, value in a.items()}
    out.update({f"capacity {compared(n, driver)}": ("quantity", c["value"])
                for n, c in device.get("capacity", {}).items()})
    return out


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[tuple[str, str], str]:
    """(name, difference) -> what each says, over every GPU of both: a difference is `only devinject`,
    `only NVIDIA`, `type` or `value`."""
    out: dict[tuple[str, str], str] = {}
    assert sorted(ours) == sorted(theirs), "the drivers publish other GPUs (by uuid)"
    for uuid in sorted(ours):
        mine, nvidia = published(ours[uuid], OURS), published(theirs[uuid], THEIRS)
        for name in sorted(mine.keys() | nvidia.keys()):
            if name not in nvidia:
                out[(name, ONLY_IN[OURS])] = f"{mine[name][0]} {mine[name][1]}"
            elif name not in mine:
                out[(name, ONLY_IN[THEIRS])] = f"{nvidia[name][0]} {nvidia[name][1]}"
            elif mine[name][0] != nvidia[name][0]:
                out[(name, "type")] = f"devinject {mine[name][0]}, NVIDIA {nvidia[name][0]}"
            elif mine[name][1] != nvidia[name][1]:
                out[(name, "value")] = f"{uuid}: devinject {mine[name][1]}, NVIDIA {nvidia[name][1]}"
    return out


def listed_differences() -> dict[tuple[str, str], str]:
    """docs/dra.md's table under SECTION: (name, difference) -> why."""
    text = DOCS.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in (*ONLY_IN.values(), "type", "value"):
            assert cells[2], f"docs/dra.md: {cells[:2]} has no reason"
            rows[(cells[0], cells[1])] = cells[2]
    return rows


def test_every_attribute_and_capacity_both_publish_is_the_same_or_listed(cluster: Cluster) -> None:
    ours, theirs = cluster.gpus(OURS), cluster.gpus(THEIRS)
    found = differences(ours, theirs)
    shared = set(published(next(iter(ours.values())), OURS)) & set(published(next(iter(theirs.values())), THEIRS))
    # the comparison read both: NVML's facts and the standard attributes on each side, the same
    assert {"productName", "cudaComputeCapability", "resource.kubernetes.io/pciBusID", "capacity memory"} <= shared
    listed = listed_differences()
    unlisted = {k: v for k, v in found.items() if k not in listed}
    assert unlisted == {}, "differences docs/dra.md does not list"
    assert sorted(set(listed) - set(found)) == [], "listed in docs/dra.md, no longer differing"


def claim_spec(driver: str, uid: str) -> Path:
    """Where each driver writes a prepared claim's CDI spec."""
    return CDI / (f"{OURS}-{uid}.json" if driver == OURS else f"k8s.{THEIRS}-claim_{uid}.yaml")


def test_a_one_gpu_claim_through_each_drivers_class_runs_on_the_node(cluster: Cluster) -> None:
    """NVIDIA's DeviceClass selector in each driver's domain (gpu_class) serves a one-GPU claim through each
    driver: both pods run on the node, each claim prepared by its own driver (its CDI spec written), and the
    specs go with the pods. Each claim asks for a GPU the other's cannot get (by uuid): the two drivers know
    nothing of each other's claims."""
    gpus = sorted(cluster.gpus(OURS))
    pods = {OURS: "one-devinject", THEIRS: "one-nvidia"}
    for (driver, name), uuid in zip(pods.items(), gpus, strict=False):
        selector = f'device.attributes["{driver}"].uuid == "{uuid}"'
        cluster.apply(
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
             "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": CLASSES[driver], "count": 1, "allocationMode": "ExactCount",
                 "selectors": [{"cel": {"expression": selector}}]}}]}}}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
             "spec": {"terminationGracePeriodSeconds": 1,
                      "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
                      "containers": [{"name": "c", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                                      "command": SLEEPER, "resources": {"claims": [{"name": "gpu"}]}}]}})
    specs = []
    try:
        for driver, name in pods.items():
            until(lambda n=name: cluster.pod(n)["status"].get("phase") == "Running", 120,  # type: ignore[misc]
                  f"pod {name} Running")
            (entry,) = cluster.pod(name)["status"]["resourceClaimStatuses"]
            claim = cluster.json("resourceclaim", entry["resourceClaimName"])
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert result["driver"] == driver, result
            specs.append(claim_spec(driver, claim["metadata"]["uid"]))
        assert [spec for spec in specs if not spec.exists()] == [], "a claim's spec was not written"
    finally:
        for name in pods.values():
            cluster.kubectl("delete", "pod", name, "--ignore-not-found", "--grace-period=1", "--wait=true",
                            timeout=120)
    until(lambda: not [spec for spec in specs if spec.exists()], 60, "both claims' specs removed (unprepared)")
