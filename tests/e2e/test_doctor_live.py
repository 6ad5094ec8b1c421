"""`devinject doctor`'s verdict against what the real runtimes do with the same files: its runtime link's ok
means the container gets the device, broken means it does not.

- podman (Debian's): containers.conf read by both (the copy under the doctor's root, the same file given to
  podman with CONTAINERS_CONF), then `podman run --device nvidia.com/gpu=0` of the fixture host's spec;
- runc: the hooks.d file `devinject install-hook` writes under the root, its hook put into the bundle's
  config.json as `--runc-snippet` says, then `runc run` of a container that asks for the GPU; and no file, no
  hook.

A missing prerequisite fails, never skips (`need`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.api import Node
from devinject.doctor import Check, DoctorOptions, diagnose
from devinject.runtimes.config import binary_version
from tests.e2e.conftest import CDI_DIR, DEVINJECT, PODMAN, Bundle, container_name, in_cdi_dir
from tests.e2e.kube import need, until
from tests.e2e.test_dra_live import DRIVER, HOST, STATE, Cluster, cluster  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.live

NAME = "nvidia.com/gpu=0"
GPU_NODE = "c3:0"  # 195:0 in hex, as stat prints it


def runtime_link(root: Path, spec_dir: Path, runtime: str, state: Path, version: str | None = None) -> Check:
    node = Node(str(root), state_dir=str(state))
    (found,) = diagnose(node, NAME, DoctorOptions(spec_dirs=(str(spec_dir),), runtime=runtime,
                                                  runtime_version=version))
    return next(c for c in found.checks if c.link == "runtime")


@pytest.fixture
def containers_conf(live_host: Path) -> Iterator[Path]:
    """The root's containers.conf (what the doctor reads), removed after."""
    path = live_host / "etc/containers/containers.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    yield path
    path.unlink(missing_ok=True)


def podman_sees_the_gpu(image: str, conf: Path) -> tuple[bool, str]:
    done = subprocess.run([*PODMAN, "--device", NAME, image, "sh", "-c", "stat -c '%t:%T' /dev/nvidia0"],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "CONTAINERS_CONF": str(conf)})
    return done.returncode == 0 and done.stdout.strip() == GPU_NODE, done.stdout + done.stderr


def test_podman_default_dirs_the_doctor_says_ok_and_the_container_gets_the_gpu(
        image: str, live_host: Path, spec_dir: Path, containers_conf: Path, tmp_path: Path) -> None:
    version = binary_version("podman")
    need(version, "podman --version")
    containers_conf.write_text("[engine]\n")
    with in_cdi_dir(spec_dir / "nvidia.com-gpu.yaml"):
        link = runtime_link(live_host, CDI_DIR, "podman", tmp_path / "state", version)
        assert link.ok is True, link
        assert f"podman {version} applies CDI from /etc/cdi, /var/run/cdi" in link.detail
        sees, out = podman_sees_the_gpu(image, containers_conf)
        assert sees, out


def test_podman_cdi_spec_dirs_the_doctor_and_podman_agree(
        image: str, live_host: Path, spec_dir: Path, containers_conf: Path, tmp_path: Path) -> None:
    """containers.conf's cdi_spec_dirs names the spec's own dir, and only it holds the spec: the doctor's verdict
    is podman's (podman 4.3 ignores the key: the doctor said ok here on the code before)."""
    version = binary_version("podman")
    need(version, "podman --version")
    need(not (CDI_DIR / "nvidia.com-gpu.yaml").exists() and not Path("/etc/cdi/nvidia.com-gpu.yaml").exists(),
         "no nvidia.com/gpu spec in the default CDI dirs (another test left one)")
    containers_conf.write_text(f'[engine]\ncdi_spec_dirs = ["{spec_dir}"]\n')
    link = runtime_link(live_host, spec_dir, "podman", tmp_path / "state", version)
    sees, out = podman_sees_the_gpu(image, containers_conf)
    assert link.ok is sees, (link, out)
    if not sees:
        assert "unresolvable CDI devices nvidia.com/gpu=0" in out
        assert f"not {spec_dir}" in link.detail and "ignores containers.conf's cdi_spec_dirs" in link.detail


def _installed_hook(live_host: Path, hooks_dir: str) -> dict[str, object] | None:
    path = live_host / hooks_dir.lstrip("/") / "10-devinject.json"
    return json.loads(path.read_text())["hook"] if path.exists() else None  # type: ignore[no-any-return]


@pytest.mark.parametrize("installed", [True, False], ids=["hook-installed", "no-hook"])
def test_runc_the_doctor_says_what_runc_does(bundle: Bundle, live_host: Path, spec_dir: Path, tmp_path: Path,
                                              installed: bool) -> None:
    hooks_dir = "/etc/containers/oci/hooks.d"
    target = live_host / hooks_dir.lstrip("/")
    shutil.rmtree(target, ignore_errors=True)
    try:
        if installed:
            target.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([DEVINJECT, "install-hook", "--hooks-dir", str(target)], check=True, capture_output=True,
                           timeout=60)
        link = runtime_link(live_host, spec_dir, "runc", tmp_path / "state")
        hook = _installed_hook(live_host, hooks_dir)
        # the bundle carries the installed hook (as --runc-snippet prints it), or none
        bundle.config["hooks"] = {}
        if hook is not None:
            hook["args"] = [*hook["args"], "--spec-dir", str(spec_dir), "--state-dir",  # type: ignore[misc]
                            str(tmp_path / "hook-state"), "--no-server"]
            bundle.config["hooks"] = {"prestart": [hook]}
        bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0 || echo absent"],
                    annotations={"cdi.k8s.io/test": NAME})
        done = bundle.run(container_name())
        assert done.returncode == 0, done.stderr
        sees = done.stdout.strip() == GPU_NODE
        assert link.ok is sees is installed, (link, done.stdout)
        if not installed:
            assert "devinject install-hook" in (link.fix or "")
    finally:
        shutil.rmtree(target, ignore_errors=True)


# ---- the kubelet link on the real cluster (../shared/kube/cluster-up.sh, CONTAINERD=bundled) ---------------------
# test_dra_live's cluster: the fake HGX host (real char nodes) and `devinject dra-driver` over it, registered with
# the real kubelet and its slices published; the cluster is taken down after (cluster-down.sh --purge).

KUBELET_DIR = Path("/var/lib/kubelet")


KUBELET_LINK = """import json, sys
from devinject.api import Node
from devinject.doctor import check_link
print(json.dumps(check_link(Node(sys.argv[1], state_dir=sys.argv[2]), sys.argv[3], "kubelet").to_json()))
"""


SLICE_LINK = """import json, sys
from devinject.api import Node
from devinject.doctor import DoctorOptions, check_link, slice_api
options = DoctorOptions(api=slice_api(sys.argv[4]), node_name=sys.argv[5])
print(json.dumps(check_link(Node(sys.argv[1], state_dir=sys.argv[2]), sys.argv[3], "slice", options).to_json()))
"""


def kubelet_link(state: Path, script: str = KUBELET_LINK, *args: str) -> dict[str, object]:
    """The doctor's kubelet link (or `script`'s) of nvidia.com/gpu=0 over the fake host (which has no driver
    libraries: the walk would stop at its libraries link), with the machine's kubelet dir bound under its root
    in a private mount namespace (the bind goes with the process)."""
    mount_point = HOST / KUBELET_DIR.relative_to("/")
    mount_point.mkdir(parents=True, exist_ok=True)
    bind = f'mount --bind {KUBELET_DIR} {mount_point} && exec "$0" "$@"'
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", bind, sys.executable, "-c",
                           script, str(HOST), str(state), NAME, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_the_slice_link_on_the_real_cluster(cluster: Cluster) -> None:  # noqa: F811
    """The node's ResourceSlices as the real API server has them, read by the doctor with the admin kubeconfig:
    the GPU published; tainted by a fatal Xid (the driver's own health loop) and clear again after put-back;
    and asked for under a node name that is not the node's, no slice at all (the admin's first mistake)."""
    from tests.e2e.test_dra_live import put_back, taints_of, xid

    need(shutil.which("unshare"), "unshare (util-linux)")
    kubeconfig = str(cluster.kube_dir / "admin.kubeconfig")
    until(lambda: (KUBELET_DIR / f"plugins_registry/{DRIVER}-reg.sock").exists(), 30, "the driver's registration")
    address = Node(str(HOST)).find(NAME)[0].address
    name = "gpu-" + address.replace(":", "-").replace(".", "-")
    until(lambda: name in {d["name"] for s in cluster.slices() for d in s["spec"].get("devices", [])}, 60,
          f"{name} in the slices")
    link = kubelet_link(STATE, SLICE_LINK, kubeconfig, cluster.node)
    assert link["ok"] is True, link
    assert str(link["detail"]).startswith(f"{name} published in dra-devinject-io-{cluster.node}-nvidia-com-gpu-"), link

    device = next(d for s in cluster.slices() for d in s["spec"].get("devices", []) if d["name"] == name)
    try:
        xid(device)
        until(lambda: taints_of(cluster, name), 30, f"{name} tainted")
        link = kubelet_link(STATE, SLICE_LINK, kubeconfig, cluster.node)
        assert link["ok"] is False, link
        assert f"is tainted: {DRIVER}/xid=79:NoSchedule since " in str(link["detail"]), link
        assert "devinject put-back nvidia.com/gpu=0" in str(link["fix"])
    finally:
        put_back(device)
    until(lambda: not taints_of(cluster, name), 30, f"{name}'s taint cleared")
    assert kubelet_link(STATE, SLICE_LINK, kubeconfig, cluster.node)["ok"] is True

    link = kubelet_link(STATE, SLICE_LINK, kubeconfig, "not-this-node")
    assert link["ok"] is False
    assert link["detail"] == ("the DRA driver is registered with the kubelet, but the API server has no "
                              f"ResourceSlice of {DRIVER} for node not-this-node"), link
    assert "--node-name must be this node's name" in str(link["fix"])


def test_the_kubelet_link_on_the_real_cluster(cluster: Cluster, tmp_path: Path) -> None:  # noqa: F811
    # the DRA driver registered and its slices published: the link holds
    need(shutil.which("unshare"), "unshare (util-linux)")
    until(lambda: (KUBELET_DIR / f"plugins_registry/{DRIVER}-reg.sock").exists(), 30, "the driver's registration")
    assert cluster.slices()
    link = kubelet_link(STATE)
    assert link["ok"] is True, link
    assert f"the DRA driver {DRIVER} is registered" in str(link["detail"])

    # the driver stopped: broken, the fix names the driver
    cluster.stop_driver()
    link = kubelet_link(STATE)
    assert link["ok"] is False, link
    assert "devinject-dra" in str(link["fix"]) or DRIVER in str(link["fix"]), link

    # the device plugin registered with the real kubelet (the node's allocatable shows it): the link holds
    log = open(tmp_path / "device-plugin.log", "ab")  # noqa: SIM115 - the plugin's log, kept for the report
    plugin = subprocess.Popen(
        [DEVINJECT, "device-plugin", "--host-root", str(HOST), "--output-dir", str(tmp_path / "plugin-cdi"),
         "--state-dir", str(tmp_path / "plugin-state"), "--kind", "nvidia.com/gpu", "--no-uevents", "--hook-path",
         DEVINJECT], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    try:
        until(lambda: cluster.json("node", cluster.node)["status"].get("allocatable", {}).get("nvidia.com/gpu")
              not in (None, "0"), 90, "nvidia.com/gpu in the node's allocatable")
        link = kubelet_link(tmp_path / "plugin-state")
        assert link["ok"] is True, link
        assert "the device plugin is registered" in str(link["detail"])
    finally:
        from tests.e2e.conftest import terminate

        terminate(plugin)
    # the plugin stopped: broken
    link = kubelet_link(tmp_path / "plugin-state")
    assert link["ok"] is False and link["fix"], link
