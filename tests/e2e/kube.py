"""What the live tests on real Kubernetes share: where ../shared/kube's scripts are, a prerequisite that fails
(never skips), and a bounded wait."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.conftest import REPO

# the cluster's scripts (their README): where DEVINJECT_KUBE points, beside the checkout, or the machine's own
KUBE = next((p for p in (Path(os.environ.get("DEVINJECT_KUBE", REPO.parent / "shared" / "kube")),
                         REPO.parent / "shared" / "kube", Path("/work/shared/kube")) if (p / "cluster-up.sh").exists()),
            REPO.parent / "shared" / "kube")
T = TypeVar("T")


def need(condition: object, reason: str) -> None:
    """A prerequisite: missing, the test fails (CI must never pass by skipping the cluster)."""
    if not condition:
        pytest.fail(f"live test prerequisite missing: {reason}", pytrace=False)


def until(condition: Callable[[], T | None], timeout: float, what: str, every: float = 0.2) -> T:
    """`condition()`'s first truthy value, polled every `every` s; an AssertionError naming `what` after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


class KubeClient:
    """kubectl against the cluster `cluster-up.sh` keeps in `kube_dir`, with the environment its scripts read
    (KUBE_DIR, CONTAINERD, KUBECONFIG)."""

    def __init__(self, kube_dir: Path, containerd: str) -> None:
        self.kube_dir = kube_dir
        self.env = {**os.environ, "KUBE_DIR": str(kube_dir), "CONTAINERD": containerd,
                    "KUBECONFIG": str(kube_dir / "admin.kubeconfig")}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        done = subprocess.run([str(self.kube_dir / "bin" / "kubectl"), *args], capture_output=True, text=True,
                              env=self.env, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, *manifests: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input="\n".join(json.dumps(m) for m in manifests))
