"""A CDI pod through a containerd 1.7 that `devinject runtime configure` set up: the bundled containerd 1.7.34
(../shared/kube/containerd.xz, its own shim) on a config made from its own `containerd config default` (with
this VM's needs, as kube-up.sh sets them: sandbox image, cgroupfs, no AppArmor, restrict_oom_score_adj) and
then configured by `devinject runtime configure --runtime containerd --spec-dir DIR`, started on its own
socket and root; the real kubelet v1.36 (kubelet.xz, standalone, as kube-up.sh runs it, but with this
containerd as its runtime endpoint); `devinject device-plugin --allocate cdi` over a live fake HGX host, whose
Allocate answers CDI device names only. A static pod asking for one GPU sees exactly the spec's device node:
nothing but containerd applying CDI from the configured spec dir can have put it there (with CDI off, as in
the default config, the same pod sees no GPU).

Run under the shared lock: it takes the kubelet's ports and /var/lib/kubelet. Everything it starts is stopped
and what it made removed (the kubelet's sysctls restored, its root dir unmounted and removed, as
kube-down.sh --purge does). A missing prerequisite fails, never skips."""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEVINJECT, require, terminate
from tests.e2e.kube import KUBE
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live

IMAGE = "localhost/busybox:1"
KUBELET_ROOT = Path("/var/lib/kubelet")
SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")
POD = "cdi-gpu"


def until(condition, timeout: float, what: str, every: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(every)


def unpack(name: str, into: Path) -> Path:
    source = KUBE / f"{name}.xz"
    require(source.exists(), f"{source}")
    target = into / name
    target.write_bytes(lzma.decompress(source.read_bytes()))
    target.chmod(0o755)
    return target


def vm_config(default: str, base: Path, cni: Path) -> str:
    """containerd's default config with what this VM needs (kube-up.sh's edits) and its own root, state and
    sockets: nothing of CDI is touched here."""
    text = default
    for pattern, value in ((r"sandbox_image = .*", f'sandbox_image = "{IMAGE}"'),
                           (r"SystemdCgroup = .*", "SystemdCgroup = false"),
                           (r"disable_apparmor = .*", "disable_apparmor = true"),
                           (r"restrict_oom_score_adj = .*", "restrict_oom_score_adj = true"),
                           (r'conf_dir = "/etc/cni/net.d"', f'conf_dir = "{cni}"'),
                           (r'bin_dir = "/opt/cni/bin"', 'bin_dir = "/usr/lib/cni"'),
                           (r'^root = .*', f'root = "{base}/root"'),
                           (r'^state = .*', f'state = "{base}/state"')):
        text, count = re.subn(pattern, value, text, flags=re.M)
        assert count >= 1, pattern
    text = re.sub(r'(\[grpc\]\n(?:.*\n)*?\s*address = )".*"', rf'\1"{base}/c.sock"', text, count=1)
    text = re.sub(r'(\[ttrpc\]\n(?:.*\n)*?\s*address = )".*"', rf'\1"{base}/c.sock.ttrpc"', text, count=1)
    text = re.sub(r'(\[debug\]\n(?:.*\n)*?\s*address = )".*"', r'\1""', text, count=1)
    return text


def kubelet_config(base: Path, socket_path: Path) -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://{socket_path}
staticPodPath: {base}/manifests
fileCheckFrequency: 2s
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
address: 127.0.0.1
readOnlyPort: 10255
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{}}
resolvConf: /etc/resolv.conf
"""


def get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read(4 << 20).decode()  # type: ignore[no-any-return]
    except OSError:
        return ""


def pod_status() -> dict[str, object] | None:
    for item in json.loads(get("http://127.0.0.1:10255/pods") or "{}").get("items") or []:
        if item["metadata"]["name"].startswith(f"{POD}-"):
            return item  # type: ignore[no-any-return]
    return None


def pod_log() -> str:
    logs = sorted(Path("/var/log/pods").glob(f"default_{POD}-*/main/0.log"))
    return logs[-1].read_text() if logs else ""


class Node:
    """containerd 1.7 on the configured config, the kubelet on it, and the device plugin; `close` undoes all."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.processes: list[subprocess.Popen[bytes]] = []
        self.sysctls = {k: subprocess.run(["sysctl", "-n", k], capture_output=True, text=True).stdout.strip()
                        for k in SYSCTLS}
        self.socket = base / "c.sock"
        self.ctr = ["ctr", "--address", str(self.socket), "-n", "k8s.io"]

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.base / f"{name}.log", "ab")  # noqa: SIM115 - the child's log, kept for the report
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env or os.environ.copy())
        log.close()
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        path = self.base / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def close(self) -> None:
        (self.base / "manifests" / f"{POD}.yaml").unlink(missing_ok=True)
        try:
            until(lambda: pod_status() is None, 60, "the pod to go")
        except AssertionError:
            pass
        for process in reversed(self.processes[1:]):  # the plugin and the kubelet, then containerd
            terminate(process)
        tasks = subprocess.run([*self.ctr, "task", "ls", "-q"], capture_output=True, text=True, timeout=30).stdout
        for task in tasks.split():
            subprocess.run([*self.ctr, "task", "kill", "-s", "SIGKILL", task], capture_output=True, timeout=30)
            subprocess.run([*self.ctr, "task", "delete", task], capture_output=True, timeout=30)
        if self.processes:
            terminate(self.processes[0])
        for key, value in self.sysctls.items():
            subprocess.run(["sysctl", "-qw", f"{key}={value}"], capture_output=True)
        mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
        for mount in sorted((m for m in mounts if m == str(KUBELET_ROOT) or m.startswith(f"{KUBELET_ROOT}/")
                             or m.startswith(f"{self.base}/")), reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(KUBELET_ROOT, ignore_errors=True)
        for directory in Path("/var/log/pods").glob(f"default_{POD}-*"):
            shutil.rmtree(directory, ignore_errors=True)
        for cgroup in Path("/sys/fs/cgroup").glob("*/kubepods"):
            for path in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    path.rmdir()
                except OSError:
                    pass
            try:
                cgroup.rmdir()
            except OSError:
                pass


def configure(containerd: Path, config: Path, cdi: Path) -> None:
    done = subprocess.run([DEVINJECT, "runtime", "configure", "--runtime", "containerd", "--config", str(config),
                           "--runtime-version", "1.7", "--spec-dir", str(cdi)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    dump = subprocess.run([str(containerd), "--config", str(config), "config", "dump"], capture_output=True,
                          text=True, timeout=60).stdout
    assert "enable_cdi = true" in dump and f'cdi_spec_dirs = ["{cdi}"]' in dump, dump


@pytest.fixture
def node() -> Iterator[tuple[Node, Path]]:
    require(os.geteuid() == 0, "needs root")
    require(shutil.which("ctr") is not None and shutil.which("runc") is not None, "ctr and runc (Debian)")
    require(not KUBELET_ROOT.exists() or not any(KUBELET_ROOT.iterdir()),
            f"{KUBELET_ROOT} empty (no other kubelet on this machine)")
    require(not get("http://127.0.0.1:10248/healthz"), "no kubelet already on 127.0.0.1:10248")
    base = Path(tempfile.mkdtemp(prefix="c17-", dir="/tmp"))  # short: unix socket paths
    running = Node(base)
    try:
        yield running, base
    finally:
        running.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("configured", [True, False], ids=["configured", "default-config"])
def test_a_pod_gets_its_cdi_gpu_through_the_configured_containerd_17(node: tuple[Node, Path],
                                                                     configured: bool) -> None:
    """Configured: the pod sees exactly the spec's GPU node. The control, containerd's default config (CDI
    off) and nothing else changed: the same pod sees no GPU, so the first case's node came from CDI."""
    running, base = node
    bin_dir = base / "bin"
    bin_dir.mkdir()
    containerd = unpack("containerd", bin_dir)
    unpack("containerd-shim-runc-v2", bin_dir)
    kubelet = unpack("kubelet", bin_dir)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
    cdi = base / "cdi"
    cdi.mkdir(mode=0o755)
    (base / "cni").mkdir()
    (base / "manifests").mkdir()

    # the config: containerd's own default, this VM's needs, then `runtime configure`
    default = subprocess.run([str(containerd), "config", "default"], capture_output=True, text=True, timeout=60)
    assert default.returncode == 0, default.stderr
    config = base / "config.toml"
    config.write_text(vm_config(default.stdout, base, base / "cni"))
    dump = subprocess.run([str(containerd), "--config", str(config), "config", "dump"], capture_output=True,
                          text=True, timeout=60).stdout
    assert "enable_cdi = false" in dump  # the default: CDI off
    if configured:
        configure(containerd, config, cdi)

    # containerd 1.7 on it, the image imported
    running.start("containerd", [str(containerd), "--config", str(config)], env)
    until(lambda: subprocess.run([*running.ctr, "version"], capture_output=True, timeout=30).returncode == 0, 30,
          f"containerd 1.7 on {running.socket}: {running.log('containerd')}")
    image = base / "busybox.tar"
    subprocess.run(["python3", str(KUBE / "mkimage.py"), str(image), IMAGE], check=True, capture_output=True,
                   timeout=120)
    subprocess.run([*running.ctr, "images", "import", str(image)], check=True, capture_output=True, timeout=120)

    # the kubelet on that containerd
    (base / "kubelet.yaml").write_text(kubelet_config(base, running.socket))
    KUBELET_ROOT.mkdir(parents=True, exist_ok=True)
    running.start("kubelet", [str(kubelet), "--config", str(base / "kubelet.yaml"), "--root-dir", str(KUBELET_ROOT),
                              "--v=2"], env)
    until(lambda: get("http://127.0.0.1:10248/healthz") == "ok", 90, f"the kubelet: {running.log('kubelet')}")
    until(lambda: (KUBELET_ROOT / "device-plugins/kubelet.sock").exists(), 30, "the kubelet's device-plugin socket")

    # the device plugin over a live fake HGX host: Allocate answers CDI names only
    builder = LibBuilder()
    try:
        host = FakeHost(base / "host", real_nodes=True)
        build_hgx_h100(builder, host)
        host.finish(ldconfig=False)
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    running.start("device-plugin", [DEVINJECT, "device-plugin", "--host-root", str(base / "host"), "--output-dir",
                                    str(cdi), "--state-dir", str(base / "state-devinject"), "--kind",
                                    "nvidia.com/gpu", "--allocate", "cdi", "--no-uevents", "--metrics-address", "",
                                    "--hook-path", DEVINJECT])
    until(lambda: list(cdi.glob("*.json")) + list(cdi.glob("*.yaml")), 30, "the plugin's CDI spec")

    script = "ls /dev | grep -E '^nvidia[0-9]+$' || echo no-gpu; echo finished; sleep 3600"
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": "default"},
                "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                         "command": ["sh", "-c", script],
                                         "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    (base / "manifests" / f"{POD}.yaml").write_text(json.dumps(manifest))
    until(lambda: "finished" in pod_log(), 120,
          f"the pod's output (status {pod_status()}; kubelet: {running.log('kubelet')[-1500:]})")
    seen = [line.split()[-1] for line in pod_log().splitlines() if re.search(r"\snvidia\d+$", line)]
    specs = [json.loads(p.read_text()) for p in cdi.glob("*.json")] or \
        [__import__("yaml").safe_load(p.read_text()) for p in cdi.glob("*.yaml")]
    nodes = {n["path"].removeprefix("/dev/") for s in specs for d in s["devices"]
             for n in d["containerEdits"].get("deviceNodes", [])}
    if configured:
        assert len(seen) == 1 and seen[0] in nodes, (pod_log(), nodes)
        assert "no-gpu" not in pod_log()
    else:
        assert seen == [] and "no-gpu" in pod_log(), pod_log()
