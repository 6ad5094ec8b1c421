"""What the live CRI tests of containerd 2.x and CRI-O share: a fake HGX host made live with its spec, crictl
against one runtime's socket, and a pod whose one container asks CRI for `nvidia.com/gpu=0` and prints the GPU
nodes it sees with their major:minor."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.conftest import DEVINJECT
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

# each GPU node the container sees, with its major:minor in hex (stat's %t:%T), then a last line
SEE_GPUS = "for n in /dev/nvidia*; do case $n in *[0-9]) stat -c '%n %t:%T' $n;; esac; done; echo finished"


@dataclass(frozen=True)
class LiveGpu:
    spec_dir: Path
    node: dict[str, Any]  # GPU 0's own device node in its spec (path, major, minor)

    @property
    def seen(self) -> dict[str, str]:
        """What SEE_GPUS prints for exactly this GPU."""
        return {self.node["path"]: f"{self.node['major']:x}:{self.node['minor']:x}"}


def live_hgx_gpu(base: Path) -> LiveGpu:
    """A fake HGX H100 host under `base/host` with real char nodes, its specs generated into `base/cdi`."""
    with contextlib.ExitStack() as cleanup:
        builder = LibBuilder()
        cleanup.callback(shutil.rmtree, builder.tmp, True)
        host = FakeHost(base / "host", real_nodes=True)
        build_hgx_h100(builder, host)
        host.finish(ldconfig=False)
    spec_dir = base / "cdi"
    spec_dir.mkdir(mode=0o755)
    subprocess.run([DEVINJECT, "generate", "--root", str(base / "host"), "--output-dir", str(spec_dir),
                    "--hook-path", DEVINJECT], check=True, capture_output=True, timeout=120)
    spec = yaml.safe_load((spec_dir / "nvidia.com-gpu.yaml").read_text())
    (gpu0,) = [d for d in spec["devices"] if d["name"] == "0"]
    (node,) = [n for n in gpu0["containerEdits"]["deviceNodes"] if re.fullmatch(r"/dev/nvidia\d+", n["path"])]
    return LiveGpu(spec_dir, node)


class Crictl:
    """crictl (../shared/peers) against one runtime's CRI socket."""

    def __init__(self, binary: Path, socket: Path) -> None:
        self.binary = binary
        self.socket = socket

    def __call__(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([str(self.binary), "-r", f"unix://{self.socket}", "-t", "60s", *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 or not check, f"crictl {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout.strip()

    def gpu_seen(self, base: Path, image: str, namespace_options: dict[str, int],
                 pod_linux: dict[str, Any] | None = None, *, cdi_devices: bool = True,
                 annotations: dict[str, str] | None = None,
                 pod_annotations: dict[str, str] | None = None) -> dict[str, str]:
        """Run a pod whose container asks for nvidia.com/gpu=0 through CRI's CDI_devices (or, without
        `cdi_devices`, only through the annotations given, the container's or the pod's); the GPU nodes it saw
        ({path: major:minor}). The pod is removed however it ends."""
        base.mkdir(exist_ok=True)
        pod = base / "pod.json"
        pod.write_text(json.dumps({"metadata": {"name": "gpu-pod", "namespace": "default", "uid": base.name},
                                   "log_directory": str(base / "logs"), "annotations": pod_annotations or {},
                                   "linux": {**(pod_linux or {}),
                                             "security_context": {"namespace_options": namespace_options}}}))
        container = base / "ctr.json"
        container.write_text(json.dumps({"metadata": {"name": "gpu"}, "image": {"image": image},
                                         "command": ["sh", "-c", SEE_GPUS], "log_path": "gpu.log",
                                         "CDI_devices": [{"name": "nvidia.com/gpu=0"}] if cdi_devices else [],
                                         "annotations": annotations or {},
                                         "linux": {"security_context": {"namespace_options": namespace_options}}}))
        pod_id = self("runp", str(pod))
        try:
            ctr_id = self("create", pod_id, str(container), str(pod))
            self("start", ctr_id)
            log = base / "logs/gpu.log"
            deadline = time.monotonic() + 60
            while not (log.exists() and "finished" in log.read_text()):
                assert time.monotonic() < deadline, self("inspect", ctr_id, check=False)[-2000:]
                time.sleep(0.3)
            return dict(line.split()[-2:] for line in log.read_text().splitlines() if " /dev/nvidia" in line)
        finally:
            self("stopp", pod_id, check=False)
            self("rmp", "-f", pod_id, check=False)
