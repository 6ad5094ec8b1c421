"""CRI-O 1.36.3 (../shared/peers/crio.sh's build) configured by `devinject runtime configure --runtime crio`: the
drop-in goes to the --config-dir CRI-O is started with (not beside --config), CRI-O reads it, and a CRI pod
through crictl asking `CDI_devices: nvidia.com/gpu=0` of a live fake HGX host (real char nodes) sees exactly that
GPU's node; doctor's runtime link reads the same dir, and the dirs CRI-O itself merges from its config and
drop-ins (`crio config`, every file of the dir in name order, `.conf` or not). CRI-O runs in the script's
private mount namespace on its own root, runroot and socket, and is stopped at the end; a missing prerequisite
fails in CI, never skips."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from devinject.runtimes.daemons import running_crio
from devinject.runtimes.status import runtime_status
from tests.e2e.conftest import DEVINJECT, require
from tests.e2e.cri import Crictl, live_hgx_gpu
from tests.e2e.kube import KUBE
from tests.e2e.peers import PEERS
from tests.e2e.peers import unpacked as unpack

pytestmark = pytest.mark.live

IMAGE = "localhost/devinject-crio/busybox:1"


def test_crio_reads_the_drop_in_from_its_config_dir_and_a_pod_gets_exactly_its_gpu(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "needs root")
    require((PEERS / "crio.sh").exists() and (PEERS / "crio.xz").exists(), f"CRI-O 1.36.3 in {PEERS}")
    for tool in ("conmon", "runc", "podman", "unshare"):
        require(shutil.which(tool) is not None, f"{tool} (Debian)")
    base = Path(tempfile.mkdtemp(prefix="crio-", dir="/tmp"))
    run = Path(f"/run/devinject-crio-{uuid.uuid4().hex[:8]}")
    cgroup = f"/devinject-crio-{uuid.uuid4().hex[:8]}"
    bin_dir = base / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "BASE": str(base), "RUN": str(run), "CRIO": str(unpack("crio", bin_dir)),
           "CONF": str(base / "crio/etc/crio.conf"), "CONFDIR": str(base / "crio/etc/conf.d"),
           "CRICTL": str(unpack("crictl", bin_dir))}
    unpack("pinns", bin_dir)
    crictl = Crictl(Path(env["CRICTL"]), run / "crio/crio.sock")
    try:
        gpu = live_hgx_gpu(base)
        cdi = gpu.spec_dir

        # the example config moved to this test's dirs; devinject writes the drop-in where CRI-O reads them
        conf = Path(env["CONF"])
        conf.parent.mkdir(parents=True)
        conf.write_text((PEERS / "crio.conf.example").read_text().replace("/tmp/peers-docker", str(base))
                        .replace("/run/peers-docker", str(run)).replace("localhost/peers-docker/busybox:1", IMAGE))
        (conf.parent / "policy.json").write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
        done = subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "crio", "--config", str(conf),
                               "--config-dir", env["CONFDIR"], "--spec-dir", str(cdi)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert (Path(env["CONFDIR"]) / "99-devinject.conf").exists() and not (conf.parent / "crio.conf.d").exists()

        # the image, then CRI-O
        archive = base / "busybox.tar"
        subprocess.run(["python3", str(KUBE / "mkimage.py"), str(archive), IMAGE], check=True, capture_output=True,
                       timeout=120)
        subprocess.run(["podman", "--root", f"{base}/crio/storage", "--runroot", f"{run}/crio/runroot",
                        "--storage-driver", "overlay", "load", "-q", "-i", str(archive)], check=True,
                       capture_output=True, timeout=120)
        started = subprocess.run(["bash", str(PEERS / "crio.sh"), "start"], capture_output=True, text=True, env=env,
                                 timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        # doctor on this machine's root reads the paths the running CRI-O was started with
        pid = int((run / "crio.pid").read_text())
        assert running_crio(pids=[pid]) == (pid, (str(conf), env["CONFDIR"]))

        # pid 1: this machine's root lacks CAP_SYS_RESOURCE for an infra container's oom_score_adj
        namespaces, linux = {"network": 2, "pid": 1}, {"cgroup_parent": cgroup}
        assert crictl.gpu_seen(base / "cri", IMAGE, namespaces, linux) == gpu.seen
        # CRI-O applies a container's cdi.k8s.io/* annotation (the kubelet's, from a device plugin's Allocate),
        # never a pod's (a pod user writes those): doctor's CRI-O link says so and warns of nothing
        request = {"cdi.k8s.io/devinject_gpu": "nvidia.com/gpu=0"}
        assert crictl.gpu_seen(base / "ann", IMAGE, namespaces, linux, cdi_devices=False,
                               annotations=request) == gpu.seen
        assert crictl.gpu_seen(base / "pod-ann", IMAGE, namespaces, linux, cdi_devices=False,
                               pod_annotations=request) == {}

        # doctor reads the dir CRI-O does: the host's /etc/crio/crio.conf.d under a root
        root = base / "doctor-root"
        (root / "etc/crio").mkdir(parents=True)
        shutil.copy(conf, root / "etc/crio/crio.conf")
        shutil.copytree(env["CONFDIR"], root / "etc/crio/crio.conf.d")
        status = runtime_status(str(root), "crio")
        assert status.spec_dirs == (str(cdi),) and status.warning is None
        assert "a container's cdi.k8s.io/* annotations, never a pod's" in status.detail
    finally:
        subprocess.run(["bash", str(PEERS / "crio.sh"), "stop"], capture_output=True, env=env, timeout=60)
        mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
        for mount in sorted((m for m in mounts if m.startswith((f"{base}/", f"{run}/"))), reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        # the pod's cgroups, deepest first (`**` yields the directories)
        for group in sorted(Path("/sys/fs/cgroup").glob(f"*/{cgroup.lstrip('/')}/**"), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                group.rmdir()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


LAYOUTS: list[dict[str, str]] = [
    {},
    {"etc/crio/crio.conf": "[crio.runtime]\ncdi_spec_dirs = ['/main']\n"},
    {"etc/crio/crio.conf": "[crio.runtime]\ncdi_spec_dirs = ['/main']\n",
     "etc/crio/crio.conf.d/10-a.conf": "[crio.runtime]\ncdi_spec_dirs = ['/a']\n"},
    {"etc/crio/crio.conf.d/10-a.conf": "[crio.runtime]\ncdi_spec_dirs = ['/a']\n",
     "etc/crio/crio.conf.d/20-no-suffix": "[crio.runtime]\ncdi_spec_dirs = ['/b']\n"},
    {"etc/crio/crio.conf.d/10-a.conf": "[crio.runtime]\ncdi_spec_dirs = ['/a', '/c']\n",
     "etc/crio/crio.conf.d/20-b.conf": "[crio.runtime]\ncgroup_manager = 'cgroupfs'\n"},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"layout-{i}" for i in range(len(LAYOUTS))])
def test_doctor_reads_the_dirs_crio_itself_merges(tmp_path: Path, layout: dict[str, str]) -> None:
    """CRI-O's own merge of its config and drop-ins (`crio config`, no daemon) against doctor's reading of the
    same files under a root."""
    require((PEERS / "crio.xz").exists(), f"CRI-O 1.36.3 in {PEERS}")
    root = tmp_path / "root"
    (root / "etc/crio/crio.conf.d").mkdir(parents=True)
    for path, text in {"etc/crio/crio.conf": "", **layout}.items():  # crio refuses a --config that is not there
        (root / path).write_text(text)
    crio = unpack("crio", tmp_path)
    done = subprocess.run([str(crio), "--config", str(root / "etc/crio/crio.conf"), "--config-dir",
                           str(root / "etc/crio/crio.conf.d"), "config"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    # `crio config` prints the merged values, some of them behind a `# ` (a template's look, not a default)
    block = re.search(r"^(?:# )?cdi_spec_dirs = \[\n(.*?)^(?:# )?\]", done.stdout, re.M | re.S)
    assert block, done.stdout[-3000:]
    merged = tuple(re.findall(r'"([^"]*)"', block.group(1)))
    assert merged and runtime_status(str(root), "crio").spec_dirs == merged
