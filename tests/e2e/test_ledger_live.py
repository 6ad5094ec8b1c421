"""The ledger under real runc: an exclusive device goes to one container at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.conftest import Bundle, container_name

pytestmark = pytest.mark.live


def _start_detached(bundle: Bundle, name: str) -> subprocess.CompletedProcess[str]:
    errors = bundle.path / f"{name}.err"
    with open(errors, "w") as err:
        done = subprocess.run(["runc", "run", "--detach", name], cwd=bundle.path, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=err, timeout=60, text=True)
    return subprocess.CompletedProcess(done.args, done.returncode, "", errors.read_text())


def test_second_container_waits_for_the_first_poststop(bundle: Bundle) -> None:
    first, second = container_name(), container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    assert _start_detached(bundle, first).returncode == 0
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=all"})
    refused = bundle.run(second)
    assert refused.returncode != 0
    assert f"is held by container {first}" in refused.stderr
    subprocess.run(["runc", "kill", first, "KILL"], check=True)
    for _ in range(100):
        if json.loads(subprocess.run(["runc", "state", first], capture_output=True, text=True).stdout or "{}").get(
                "status") == "stopped":
            break
        time.sleep(0.05)
    subprocess.run(["runc", "delete", first], check=True)  # runs the poststop hook: the device is released
    subprocess.run(["runc", "delete", "-f", second], capture_output=True)
    allowed = bundle.run(second)
    assert allowed.returncode == 0, allowed.stderr
    ledger = json.loads((bundle.state_dir / "ledger.json").read_text())
    assert first not in ledger["allocations"]


def test_container_killed_without_poststop_is_reclaimed(bundle: Bundle) -> None:
    first, second = container_name(), container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    assert _start_detached(bundle, first).returncode == 0
    pid = json.loads(subprocess.run(["runc", "state", first], capture_output=True, text=True, check=True).stdout)["pid"]
    os.kill(pid, signal.SIGKILL)  # no runc delete: poststop never runs
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.05)
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(second)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line)["event"] for line in (bundle.state_dir / "events.jsonl").read_text().splitlines()]
    assert "container-gone" in events
