"""MPS across claims, live with runc (issue 40, item 1): two claims packed onto one GPU by consumable capacity,
prepared by the DRA driver with the stand-in nvidia-cuda-mps-control of tests/integration/test_dra_sharing.py,
and a runc container per claim given its claim's MPS mounts as the CDI spec says. Pod A (uid 0, runc's default
capabilities) replaces its daemon's `control` with its own server and writes 32 MiB into its pipe directory:
pod B never sees A's server (its pipe directory is its own daemon's), the state dir (a small tmpfs, as
/run/devinject) keeps its room, and devinject finds A's replaced socket and starts A's daemon again where A's
next container finds it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.agent.mps import MpsDaemons
from devinject.dra.capacity import CapacitySharing
from devinject.dra.driver import DraDriver
from devinject.linux import syscalls
from tests.e2e.conftest import container_name, make_rootfs
from tests.integration.test_dra_driver import DRIVER, FakeApi, make_driver
from tests.integration.test_dra_sharing import STAND_IN, kill_stand_ins, unmount_under
from tests.integration.test_mps_per_claim import UID_A, UID_B, share

pytestmark = pytest.mark.live
STATE_BYTES = 16 << 20  # the state dir's tmpfs: small, as a node's /run/devinject


class Node:
    def __init__(self, work: Path, driver: DraDriver) -> None:
        self.work = work
        self.driver = driver
        self.state = str(work / "state")
        self.daemons = MpsDaemons(self.state, str(work / "driver"))

    def run(self, uid: str, script: str) -> str:
        """`script` in a runc container of claim `uid`: busybox, uid 0, runc's default capabilities, the
        claim's MPS mounts as its CDI spec has them. Its output."""
        spec = json.loads(Path(self.work, "cdi", f"{DRIVER}-{uid}.json").read_text())
        (device,) = spec["devices"]
        bundle = Path(tempfile.mkdtemp(dir=self.work, prefix="bundle-"))
        rootfs = make_rootfs(bundle / "rootfs")
        for applet in ("dd", "rm"):
            (rootfs / "bin" / applet).symlink_to("busybox")
        subprocess.run(["runc", "spec"], cwd=bundle, check=True)
        config = json.loads((bundle / "config.json").read_text())
        config["process"].update(terminal=False, args=["sh", "-c", script], env=["PATH=/bin"])
        config["root"]["readonly"] = False
        config["mounts"] += [{"destination": m["containerPath"], "type": "bind", "source": m["hostPath"],
                              "options": m["options"]} for m in device["containerEdits"]["mounts"]]
        (bundle / "config.json").write_text(json.dumps(config))
        done = subprocess.run(["runc", "run", container_name()], cwd=bundle, capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        return done.stdout


@pytest.fixture(scope="module")
def node(live_root: None) -> Iterator[Node]:
    work = Path(tempfile.mkdtemp(prefix="mps-live-", dir="/tmp"))
    state = work / "state"
    state.mkdir(mode=0o755)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STATE_BYTES},mode=0755", "tmpfs", str(state)],
                   check=True)
    control = work / "driver/usr/bin/nvidia-cuda-mps-control"
    control.parent.mkdir(parents=True)
    control.write_text(STAND_IN)
    control.chmod(0o755)
    try:
        api = FakeApi()
        share(api, "a", UID_A, "5b0c2f0e-aaaa-4c1b-9a55-00000000000a")
        share(api, "b", UID_B, "5b0c2f0e-bbbb-4c1b-9a55-00000000000b")
        dirs = {name: str(work / name) for name in ("plugins", "registry", "cdi", "state")}
        driver = make_driver(dirs, api)
        driver.opts = replace(driver.opts, capacity=CapacitySharing(4, 40 << 30))
        driver.preparer.mps = MpsDaemons(str(state), str(work / "driver"))
        driver.preparer.prepare("default", "a", UID_A)
        driver.preparer.prepare("default", "b", UID_B)
        yield Node(work, driver)
    finally:
        kill_stand_ins(str(work / "driver"))
        unmount_under(str(state))
        syscalls.umount(str(state))
        shutil.rmtree(work, ignore_errors=True)


def test_pod_b_never_reaches_pod_as_server_and_pod_a_cannot_fill_the_state_dir(node: Node) -> None:
    free = os.statvfs(node.state).f_bavail * os.statvfs(node.state).f_frsize
    said = node.run(UID_A, "rm /tmp/nvidia-mps/control && echo A-server > /tmp/nvidia-mps/control && "
                           "dd if=/dev/zero of=/tmp/nvidia-mps/fill bs=1M count=32 2>&1; echo dd=$?; "
                           "cat /tmp/nvidia-mps/control")
    assert "A-server" in said and "dd=0" not in said and "No space left" in said, said  # its own tmpfs is full
    left = os.statvfs(node.state).f_bavail * os.statvfs(node.state).f_frsize
    assert left > free - (1 << 20), (free, left)  # the state dir's room is untouched
    Path(node.state, "ledger-sized-write").write_bytes(bytes(1 << 20))
    seen = node.run(UID_B, "cat /tmp/nvidia-mps/control; echo; ls /tmp/nvidia-mps")
    assert "A-server" not in seen and "fill" not in seen, seen  # its own daemon's directory
    assert node.daemons.running() == {"0000:2a:00.0": [UID_B]}  # A's daemon is not called alive
    node.driver.preparer.rebook()  # the driver's round: A's daemon stopped and started again
    assert node.daemons.running() == {"0000:2a:00.0": sorted([UID_A, UID_B])}
    again = node.run(UID_A, "cat /tmp/nvidia-mps/control; echo; ls /tmp/nvidia-mps")
    assert "A-server" not in again and "fill" not in again and "control" in again, again
