"""`devinject doctor` on a fixture host made live (real char nodes, a spec generated into a trusted dir, a
runtime config that applies CDI from it): every link holds; then each link is broken in turn and the doctor
names that link, with its fix, and checks nothing after it."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.api import Node
from devinject.cli import cli
from devinject.doctor import DoctorOptions, diagnose
from tests.conftest import HOSTS
from tests.e2e.conftest import require, stand_ins
from tests.unit import test_kubeapi
from tests.unit.test_kubeapi import Recorder, certs, kubeconfig  # noqa: F401 - `server` needs `certs`

# the fake API server (pytest knows a fixture by the name it is bound to here)
fake_api_server = test_kubeapi.server


@pytest.fixture
def fake_api_ca(certs: Path) -> Path:  # noqa: F811 - test_kubeapi's fixture
    """The fake API server's certificate, its own CA."""
    return certs / "server.crt"

DEVINJECT = str(Path(sys.executable).parent / "devinject")
GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
NAME = "nvidia.com/gpu=0"
CONTAINERD = """version = 2
[plugins."io.containerd.grpc.v1.cri"]
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
"""


class Live:
    def __init__(self, base: Path) -> None:
        self.root = base / "host"
        self.cdi = base / "cdi"
        self.state = base / "state"
        shutil.copytree(HOSTS / "hgx-h100", self.root, symlinks=True)
        for found in Node(str(self.root)).devices():
            for node in found.nodes:
                path = self.root / node.path.lstrip("/")
                path.unlink(missing_ok=True)
                assert node.major is not None and node.minor is not None
                os.mknod(path, 0o020666, os.makedev(node.major, node.minor))
                os.chmod(path, 0o666)
        self.cdi.mkdir(mode=0o755)
        self.generate()
        self.containerd(CONTAINERD.format(cdi=self.cdi))

    def generate(self, hook_path: str = DEVINJECT) -> None:
        subprocess.run([DEVINJECT, "generate", "--root", str(self.root), "--output-dir", str(self.cdi),
                        "--hook-path", hook_path], check=True, capture_output=True, timeout=60)

    def containerd(self, text: str) -> None:
        config = self.root / "etc/containerd/config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(text)

    def diagnose(self, device: str | None = NAME, **options: object) -> list:
        node = Node(str(self.root), state_dir=str(self.state))
        return diagnose(node, device, DoctorOptions(spec_dirs=(str(self.cdi),), **options))  # type: ignore[arg-type]


@pytest.fixture
def live() -> Iterator[Live]:
    require(os.geteuid() == 0, "needs root (mknod)")
    base = Path(tempfile.mkdtemp(prefix="doc", dir="/tmp"))  # short: a unix socket's path fits in 108 bytes
    try:
        yield Live(base)
    finally:
        shutil.rmtree(base)


def _links(found: list) -> list[tuple[str, bool | None]]:
    return [(c.link, c.ok) for c in found[0].checks]


def test_every_link_holds_on_a_live_host(live: Live):
    found = live.diagnose()
    assert [d.name for d in found] == [NAME]
    assert _links(found) == [(link, True) for link in
                             ("pci", "driver", "nodes", "libraries", "spec", "runtime", "ledger", "health")]
    assert found[0].ok
    checks = {c.link: c for c in found[0].checks}
    assert "version 550.54.14" in checks["libraries"].detail
    assert f"{live.cdi}/nvidia.com-gpu.yaml names nvidia.com/gpu=0" in checks["spec"].detail
    assert checks["ledger"].detail.startswith("free")


def _write(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    path.write_text(text)


def _remake(path: Path, minor: int) -> None:
    path.unlink()
    os.mknod(path, 0o020666, os.makedev(195, minor))


BREAKS: list[tuple[str, Callable[[Live], None], str, str]] = [
    ("driver", lambda h: (h.root / GPU / "driver").unlink(), "no driver bound (expected nvidia)",
     "> {root}/sys/bus/pci/drivers/nvidia/bind"),
    ("driver", lambda h: shutil.rmtree(h.root / "sys/module/nvidia"), "module nvidia is not loaded",
     "modprobe nvidia"),
    # the fixes name the node under the root doctor was given, not the machine's own /dev
    ("nodes", lambda h: (h.root / "dev/nvidia2").unlink(), "dev/nvidia2 is missing",
     "mknod {root}/dev/nvidia2 c 195 2"),
    ("nodes", lambda h: _remake(h.root / "dev/nvidia2", 7), "is 195:7, the driver's is 195:2",
     "rm {root}/dev/nvidia2; mknod {root}/dev/nvidia2 c 195 2"),
    ("nodes", lambda h: _write(h.root / "dev/nvidia2", ""), "dev/nvidia2 is not a char device",
     "(mknod {root}/dev/nvidia2 c 195 2)"),
    ("libraries", lambda h: _write(h.root / "proc/driver/nvidia/version",
                                   "NVRM version: NVIDIA UNIX x86_64 Kernel Module  560.35.03  Tue\n"),
     "libraries are 550.54.14, the running module is 560.35.03", "reboot"),
    ("spec", lambda h: (h.cdi / "nvidia.com-gpu.yaml").unlink(), "names nvidia.com/gpu=0", "devinject generate"),
    # the hook refuses a name two files of one dir define; the doctor asks the hook's registry (it said "fine")
    ("spec", lambda h: shutil.copy(h.cdi / "nvidia.com-gpu.yaml", h.cdi / "nvidia.com-gpu-2.yaml"),
     "unresolvable CDI device nvidia.com/gpu=0: defined in both", "devinject cdi list --spec-dir {cdi}"),
    ("spec", lambda h: os.chmod(h.cdi / "nvidia.com-gpu.yaml", 0o666), "writable by group or others",
     "devinject validate"),
    ("spec", lambda h: h.generate("/nonexistent/devinject"), "hook /nonexistent/devinject cannot run on this node",
     "--hook-path"),
    ("spec", lambda h: _write(h.cdi / "nvidia.com-gpu.yaml", (h.cdi / "nvidia.com-gpu.yaml").read_text()
                              .replace("minor: 2\n", "minor: 12\n", 1)), "stale", "devinject generate"),
    ("runtime", lambda h: h.containerd('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = false\n'),
     "enable_cdi is off", "devinject runtime configure --runtime containerd"),
    ("runtime", lambda h: h.containerd(CONTAINERD.format(cdi="/etc/cdi")), "not " + "{cdi}",
     "--spec-dir {cdi}"),
    ("health", lambda h: _write(h.root / GPU / "enable", "0\n"), "unhealthy: ", "devinject put-back nvidia.com/gpu=0"),
]


@pytest.mark.parametrize(("link", "breaks", "detail", "fix"), BREAKS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BREAKS)])
def test_each_broken_link_is_named_with_its_fix(live: Live, link: str, breaks: Callable[[Live], None], detail: str,
                                                fix: str):
    breaks(live)
    found = live.diagnose()
    assert len(found) == 1 and not found[0].ok
    broken = found[0].broken
    assert broken is not None and broken.link == link, [(c.link, c.ok, c.detail) for c in found[0].checks]
    assert detail.format(cdi=live.cdi) in broken.detail
    assert fix.format(cdi=live.cdi, root=live.root) in (broken.fix or ""), broken.fix
    after = [c for c in found[0].checks][[c.link for c in found[0].checks].index(link) + 1:]
    assert all(c.ok is None for c in after)


V4_DEFAULT = """version = 4
imports = ['/etc/containerd/conf.d/*.toml']
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']
"""
NEWER_DROP_IN = """version = 3
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ['{cdi}']
"""
# (the runtime's config under the host root, the runtime and version doctor is told, what the broken link says)
RUNTIME_BREAKS: list[tuple[dict[str, str], str, str | None, str]] = [
    ({"etc/containerd/config.toml": 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = false\n'},
     "containerd", "1.7", "containerd 1.7: enable_cdi is off"),
    ({"etc/containerd/config.toml": 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "p"\n'},
     "containerd", "1.7.34", "containerd 1.7.34: enable_cdi is off"),
    # an upgraded node's version 2 file: 2.x applies CDI by default, from CDI's default dirs
    ({"etc/containerd/config.toml": 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "p"\n'},
     "containerd", "2.3.4", "containerd 2.3.4 applies CDI from /etc/cdi, /var/run/cdi"),
    ({"etc/containerd/config.toml": "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = false\n"},
     "containerd", "2.1.0", "containerd 2.1.0: enable_cdi is off"),
    ({"etc/containerd/config.toml": V4_DEFAULT}, "containerd", "2.3.4",
     "containerd 2.3.4 applies CDI from /etc/cdi, /var/run/cdi"),
    ({"etc/containerd/config.toml": V4_DEFAULT}, "containerd", None,
     "containerd 2.x applies CDI from /etc/cdi, /var/run/cdi"),
    ({}, "containerd", "2.3.4", "containerd 2.3.4 applies CDI from /etc/cdi, /var/run/cdi (no "),
    # an older devinject's version 3 drop-in under a version 2 root: 2.3.0-2.3.4 do not start
    ({"etc/containerd/config.toml": "version = 2\nimports = ['/etc/containerd/conf.d/*.toml']\n",
      "etc/containerd/conf.d/99-devinject.toml": NEWER_DROP_IN}, "containerd", "2.3.2",
     "99-devinject.toml is a version 3 drop-in, above the root config's version 2"),
    ({"etc/crio/crio.conf": "[crio.runtime]\ncgroup_manager = 'cgroupfs'\n"}, "crio", None,
     "CRI-O applies CDI from /etc/cdi, /var/run/cdi"),
    ({"etc/crio/crio.conf": "[crio.runtime]\n", "etc/crio/crio.conf.d/50-admin.conf":
      "[crio.runtime]\ncdi_spec_dirs = ['/opt/vendor']\n"}, "crio", None, "CRI-O applies CDI from /opt/vendor"),
]


@pytest.mark.parametrize(("files", "runtime", "version", "detail"), RUNTIME_BREAKS,
                         ids=[f"{b[1]}-{b[2]}-{i}" for i, b in enumerate(RUNTIME_BREAKS)])
def test_the_runtime_links_fix_works_when_applied(live: Live, files: dict[str, str], runtime: str,
                                                  version: str | None, detail: str):
    """Each runtime and version says which dirs it reads and names a fix; running that fix (`runtime
    configure` under the same root) makes the link hold, and the admin's dirs stay read."""
    (live.root / "etc/containerd/config.toml").unlink()
    for path, text in files.items():
        (live.root / path).parent.mkdir(parents=True, exist_ok=True)
        (live.root / path).write_text(text.format(cdi=live.cdi))
    options = {"runtime": runtime, "runtime_version": version}
    broken = live.diagnose(**options)[0].broken
    assert broken is not None and broken.link == "runtime" and detail in broken.detail, broken
    assert broken.fix and broken.fix.startswith("devinject runtime configure ") and f"--root {live.root}" in \
        broken.fix, broken.fix
    command, _, restart = broken.fix.partition(", then ")
    assert restart == {"containerd": "systemctl restart containerd", "crio": "systemctl restart crio"}[runtime]
    done = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert done.exit_code == 0, done.output
    runtime_link = next(c for c in live.diagnose(**options)[0].checks if c.link == "runtime")
    assert runtime_link.ok is True, runtime_link.detail
    assert str(live.cdi) in runtime_link.detail
    if "/opt/vendor" in detail:
        assert "/opt/vendor" in runtime_link.detail


def test_a_2x_node_without_a_config_and_no_version_asks_for_it(live: Live):
    (live.root / "etc/containerd/config.toml").unlink()
    broken = live.diagnose(runtime="containerd")[0].broken
    assert broken is not None and broken.link == "runtime" and "containerd's version unknown" in broken.detail
    assert broken.fix == "give --runtime-version (containerd --version)"


def test_a_function_that_is_gone_is_no_device_and_the_candidates_are_named(live: Live):
    (live.root / "sys/bus/pci/devices/0000:18:00.0").unlink()  # the bus link, as a removed function leaves it
    from devinject.core.errors import DevinjectError

    # the one line every command that takes a DEVICE gives (discovery/resolve.py)
    with pytest.raises(DevinjectError, match=r"^0000:18:00.0: no such device under \S+; devices: .*nvidia.com/gpu=0, "):
        live.diagnose("0000:18:00.0")


def test_pod_annotations_passed_through_are_flagged_not_failed(live: Live):
    live.containerd(CONTAINERD.format(cdi=live.cdi) + '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
                    '  pod_annotations = ["cdi.k8s.io/*"]\n')
    runtime = next(c for c in live.diagnose()[0].checks if c.link == "runtime")
    assert runtime.ok is True and "warning: pod annotations reach the OCI spec (runc: cdi.k8s.io/*)" in runtime.detail
    assert runtime.fix and "pod_annotations" in runtime.fix


def test_the_ledger_names_who_holds_it(live: Live):
    from devinject.nodestate.ledger import Claim, Ledger

    live.state.mkdir(mode=0o755)
    Ledger(str(live.state)).book("ctr-1", os.getpid(), (Claim(NAME, ("c 195:2",)),), {"nvidia.com/gpu": "exclusive"})
    ledger = next(c for c in live.diagnose()[0].checks if c.link == "ledger")
    assert ledger.ok is True and f"held by ctr-1 (pid {os.getpid()}, active)" in ledger.detail


def test_the_kubelet_link_on_a_kubernetes_node(live: Live):
    plugins = live.root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    kubelet = next(c for c in live.diagnose()[0].checks if c.link == "kubelet")
    assert kubelet.ok is False and "no devinject plugin registered" in kubelet.detail
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        path = plugins / "devinject-nvidia.com-gpu.sock"
        server.bind(str(path))
        server.listen(1)
        kubelet = next(c for c in live.diagnose()[0].checks if c.link == "kubelet")
        assert kubelet.ok is True and "the device plugin is registered" in kubelet.detail
    finally:
        server.close()
    kubelet = next(c for c in live.diagnose()[0].checks if c.link == "kubelet")
    assert kubelet.ok is False and "nothing answers" in kubelet.detail


def test_the_command_prints_one_line_per_link_and_json(live: Live):
    base = [DEVINJECT, "doctor", "--root", str(live.root), "--spec-dir", str(live.cdi), "--state-dir",
            str(live.state)]
    done = subprocess.run([*base, NAME], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == NAME and len(done.stdout.splitlines()) == 9
    (live.root / GPU / "driver").unlink()
    done = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    rows = {d["name"]: d for d in json.loads(done.stdout)}
    assert rows["nvidia.com/gpu=0000:18:00.0"]["checks"][1]["link"] == "driver"
    assert rows["nvidia.com/gpu=0000:18:00.0"]["checks"][1]["ok"] is False
    assert rows["nvidia.com/gpu=1"]["ok"] is True and len(rows) == 16


def test_a_time_sliced_gpu_is_explained_and_its_renamed_plugin_found(live: Live):
    """The device plugin time-slices the GPUs 2 ways as nvidia.com/gpu.shared: the ledger link counts the
    containers on it and says when another would be refused; the kubelet link looks for the renamed socket."""
    from devinject.nodestate.ledger import Claim, Ledger
    from devinject.nodestate.profilefacts import write_time_slicing

    live.state.mkdir(mode=0o755)
    write_time_slicing(str(live.state), {"nvidia.com/gpu": 2}, {"nvidia.com/gpu": "nvidia.com/gpu.shared"})
    ledger = Ledger(str(live.state))
    with stand_ins(2) as (one, two):
        ledger.book("ctr-1", one.pid, (Claim(NAME, ("c 195:2",)),))
        check = next(c for c in live.diagnose()[0].checks if c.link == "ledger")
        assert check.ok is True and "time-sliced 2 ways by the device plugin, 1 held: ctr-1" in check.detail
        assert "full" not in check.detail
        ledger.book("ctr-2", two.pid, (Claim(NAME, ("c 195:2",)),))
        check = next(c for c in live.diagnose()[0].checks if c.link == "ledger")
        assert "2 held" in check.detail and "full: another container is refused" in check.detail
    plugins = live.root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(plugins / "devinject-nvidia.com-gpu.shared.sock"))
        server.listen(1)
        kubelet = next(c for c in live.diagnose()[0].checks if c.link == "kubelet")
        assert kubelet.ok is True and "gpu.shared.sock" in kubelet.detail
    finally:
        server.close()



def test_the_slice_link_reads_the_node_slices_once_for_every_device(live: Live, tmp_path: Path, fake_api_server: int,
                                                                     fake_api_ca: Path):
    """With an API server (a real HTTPS server on loopback, as tests/unit/test_doctor_slices.py's), every link
    holds up to the node's ResourceSlices, listed once for all the devices; a GPU left out of them is the one
    broken link, named with its pool."""
    from devinject.dra.kubeapi import ResourceApi, credentials
    from devinject.dra.slices import offers, resource_slices

    registry = live.root / "var/lib/kubelet/plugins_registry"
    registry.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(registry / "dra.devinject.io-reg.sock"))
        listener.listen(64)  # the kubelet link connects once per device

        def accept() -> None:
            while True:
                try:
                    listener.accept()[0].close()
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()
        items = json.loads(json.dumps(resource_slices("dra.devinject.io", "node1",
                                                      offers(Node(str(live.root)), "node1"))))
        Recorder.answers[("GET", "/apis/resource.k8s.io/v1/resourceslices")] = (200, {"items": items})
        config = kubeconfig(tmp_path / "kc", fake_api_server, fake_api_ca, token="t")
        api = ResourceApi(credentials(str(config)), timeout=2, budget=2)
        found = live.diagnose(None, api=api, node_name="node1", metrics_address=None)
        gpus = [d for d in found if d.kind == "nvidia.com/gpu"]
        assert len(gpus) == 8 and all(d.ok for d in gpus), [d.broken for d in gpus if not d.ok]
        assert [c.link for c in gpus[0].checks][-2:] == ["kubelet", "slice"]
        # one list of the slices and one of the DeviceTaintRules for every device's walk
        assert [seen["path"].split("?")[0] for seen in Recorder.seen] == [
            "/apis/resource.k8s.io/v1/resourceslices", "/apis/resource.k8s.io/v1/devicetaintrules"]
        for item in items:
            item["spec"]["devices"] = [d for d in item["spec"].get("devices", []) if d["name"] != "gpu-0000-18-00-0"]
        (gpu0,) = live.diagnose(NAME, api=api, node_name="node1", metrics_address=None)
        assert gpu0.broken is not None and gpu0.broken.link == "slice"
        assert gpu0.broken.detail.startswith("gpu-0000-18-00-0 is not in pool node1-nvidia-com-gpu at generation 1")
    finally:
        listener.close()
