"""MPS across claims never shares a daemon (issue 40, item 1): two claims packed onto one GPU by consumable
capacity each get their own control daemon and pipe directory, on a tmpfs of their own apart from the state
dir; a `control` socket a pod replaced is found (its inode) and its daemon started again, never called alive;
a pod filling its pipe directory fills its own tmpfs only. The daemons' record survives a restart of the driver
and a corrupt daemons.json. The control program runs as root only when root alone could change it."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.agent import mps
from devinject.agent.mps import MpsDaemons
from devinject.dra.capacity import CapacitySharing
from devinject.dra.claims import PrepareError
from devinject.dra.driver import DraDriver
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, FakeApi, make_driver
from tests.integration.test_dra_sharing import alive, dirs, kill_stand_ins, mounted_under, unmount_under

GPU = "gpu-0000-2a-00-0"
ADDRESS = "0000:2a:00.0"
UID_A, UID_B = "0b7f8e7c-5555-4c1b-9a55-00000000000a", "0b7f8e7c-5555-4c1b-9a55-00000000000b"
MPS_CONFIG = [{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": DRIVER, "parameters": {
    "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}}}]
TMPFS_BYTES = 8 << 20  # MOUNT_OPTIONS' size
__all__ = ["dirs"]  # the fixture: a driver root with the stand-in nvidia-cuda-mps-control


def share(api: FakeApi, name: str, uid: str, share_id: str) -> None:
    """A claim the scheduler allocated one share of GPU, an MPS client."""
    api.add(name, uid, [(GPU_POOL, GPU)], config=MPS_CONFIG)
    result = api.claims[("default", name)]["status"]["allocation"]["devices"]["results"][0]
    result["shareID"] = share_id
    result["consumedCapacity"] = {"memory": "10Gi", "shares": "1"}


@pytest.fixture(autouse=True)
def nothing_left(dirs: dict[str, str]) -> Iterator[None]:
    """No stand-in daemon nor tmpfs outlives a test."""
    yield
    kill_stand_ins(dirs["driver"])
    unmount_under(dirs["state"])


def packed(dirs: dict[str, str]) -> DraDriver:
    """A driver with consumable capacity whose API server holds claims a and b, one share each of GPU."""
    api = FakeApi()
    share(api, "a", UID_A, "5b0c2f0e-aaaa-4c1b-9a55-00000000000a")
    share(api, "b", UID_B, "5b0c2f0e-bbbb-4c1b-9a55-00000000000b")
    driver = make_driver(dirs, api)
    driver.opts = replace(driver.opts, capacity=CapacitySharing(4, 40 << 30))
    driver.preparer.mps = MpsDaemons(dirs["state"], dirs["driver"])
    return driver


def pipe_of(dirs: dict[str, str], uid: str) -> str:
    spec = json.loads(Path(dirs["cdi"], f"{DRIVER}-{uid}.json").read_text())
    (device,) = spec["devices"]
    return next(m["hostPath"] for m in device["containerEdits"]["mounts"] if m["containerPath"] == "/tmp/nvidia-mps")


def record(dirs: dict[str, str], uid: str) -> dict[str, object]:
    data = json.loads(Path(dirs["state"], "mps", "daemons.json").read_text())
    return next(e for e in data.values() if e["holder"] == uid)  # type: ignore[no-any-return]


def test_two_claims_on_one_gpu_each_have_their_own_daemon_on_their_own_tmpfs(dirs: dict[str, str]) -> None:
    driver = packed(dirs)
    driver.preparer.prepare("default", "a", UID_A)
    driver.preparer.prepare("default", "b", UID_B)
    pipe_a, pipe_b = pipe_of(dirs, UID_A), pipe_of(dirs, UID_B)
    assert pipe_a != pipe_b and Path(pipe_a, "control").exists() and Path(pipe_b, "control").exists()
    pid_a, pid_b = record(dirs, UID_A)["pid"], record(dirs, UID_B)["pid"]
    assert pid_a != pid_b and alive(pid_a) and alive(pid_b)  # type: ignore[arg-type]
    assert MpsDaemons(dirs["state"], dirs["driver"]).running() == {ADDRESS: sorted([UID_A, UID_B])}
    state = os.stat(dirs["state"]).st_dev
    assert len({state, os.stat(pipe_a).st_dev, os.stat(pipe_b).st_dev}) == 3  # three filesystems
    driver.preparer.unprepare(UID_A)  # one claim gone: its daemon and tmpfs go, the other's stay
    assert not alive(pid_a) and alive(pid_b)  # type: ignore[arg-type]
    assert not Path(pipe_a).exists() and Path(pipe_b, "control").exists()
    driver.preparer.unprepare(UID_B)
    assert not alive(pid_b) and mounted_under(dirs["state"]) == []  # type: ignore[arg-type]


def test_a_replaced_control_socket_is_not_called_alive_and_its_daemon_starts_again(dirs: dict[str, str]) -> None:
    """Pod A unlinks its daemon's `control` and binds its own: devinject sees another inode, does not call
    the daemon alive, stops it (no `quit` through the planted socket) and starts it again in the same pipe
    directory (the one the pods have mounted), emptied of what the pod planted."""
    driver = packed(dirs)
    driver.preparer.prepare("default", "a", UID_A)
    driver.preparer.prepare("default", "b", UID_B)
    pipe_a = Path(pipe_of(dirs, UID_A))
    before, other = record(dirs, UID_A), record(dirs, UID_B)
    (pipe_a / "control").unlink()
    (pipe_a / "control").write_text("the pod's server")
    (pipe_a / "planted").write_text("x")
    daemons = MpsDaemons(dirs["state"], dirs["driver"])
    assert daemons.running() == {ADDRESS: [UID_B]}  # not alive the moment its socket is not its own
    driver.preparer.rebook()  # the driver's round: check()
    after = record(dirs, UID_A)
    assert after["pid"] != before["pid"] and not alive(before["pid"]) and alive(after["pid"])  # type: ignore[arg-type]
    assert (pipe_a / "control").read_text() == "" and not (pipe_a / "planted").exists()
    assert after["control"] == [os.lstat(pipe_a / "control").st_dev, os.lstat(pipe_a / "control").st_ino]
    assert record(dirs, UID_B) == other  # claim b's daemon untouched
    assert daemons.running() == {ADDRESS: sorted([UID_A, UID_B])}


def test_a_pod_filling_its_pipe_directory_fills_its_own_tmpfs_only(dirs: dict[str, str]) -> None:
    driver = packed(dirs)
    driver.preparer.prepare("default", "a", UID_A)
    driver.preparer.prepare("default", "b", UID_B)
    pipe_a, pipe_b = pipe_of(dirs, UID_A), pipe_of(dirs, UID_B)
    written = 0
    with pytest.raises(OSError) as full, open(os.path.join(pipe_a, "fill"), "wb") as fill:
        for _ in range(32):  # 32 MiB, as the attack
            fill.write(bytes(1 << 20))
            fill.flush()
            written += 1 << 20
    assert full.value.errno == errno.ENOSPC and written <= TMPFS_BYTES
    assert f"size={TMPFS_BYTES >> 20}m" in mps.MOUNT_OPTIONS
    assert os.statvfs(pipe_b).f_bavail * os.statvfs(pipe_b).f_frsize > TMPFS_BYTES // 2  # b's has room
    Path(dirs["state"], "still-writable").write_bytes(bytes(1 << 20))  # the state dir is not where it went
    driver.preparer.unprepare(UID_A)
    assert not Path(pipe_a).exists()


def test_the_record_survives_a_restart_and_a_corrupt_file(dirs: dict[str, str]) -> None:
    driver = packed(dirs)
    driver.preparer.prepare("default", "a", UID_A)
    driver.preparer.prepare("default", "b", UID_B)
    pids = {uid: record(dirs, uid)["pid"] for uid in (UID_A, UID_B)}
    Path(dirs["state"], "mps", "daemons.json").write_text('{"x": [')  # corrupt, and every process restarted
    again = packed(dirs)
    again.preparer.rebook()
    assert {uid: record(dirs, uid)["pid"] for uid in (UID_A, UID_B)} == pids  # adopted, none started twice
    assert MpsDaemons(dirs["state"], dirs["driver"]).running() == {ADDRESS: sorted([UID_A, UID_B])}
    again.preparer.unprepare(UID_A)
    again.preparer.unprepare(UID_B)
    assert not any(alive(p) for p in pids.values()) and mounted_under(dirs["state"]) == []  # type: ignore[arg-type]


def test_a_control_program_another_user_could_change_is_refused_and_never_run(dirs: dict[str, str]) -> None:
    control = Path(dirs["driver"], "usr/bin/nvidia-cuda-mps-control")
    control.write_text('#!/bin/sh\n: > "$(dirname "$0")/ran"\n')
    os.chown(control, 1000, 1000)
    control.chmod(0o777)
    driver = packed(dirs)
    with pytest.raises(PrepareError) as caught:
        driver.preparer.prepare("default", "a", UID_A)
    assert caught.value.message == (f"claim default/a: {control}: owned by uid 1000, not root; refused (it would "
                                    "run as root)")
    assert not Path(dirs["driver"], "usr/bin/ran").exists() and driver.preparer.prepared() == {}
    assert mounted_under(dirs["state"]) == []


def test_a_daemon_that_does_not_start_leaves_no_tmpfs(dirs: dict[str, str]) -> None:
    Path(dirs["driver"], "usr/bin/nvidia-cuda-mps-control").write_text("#!/bin/sh\nexit 7\n")
    driver = packed(dirs)
    with pytest.raises(PrepareError, match=r"claim default/a: .*nvidia-cuda-mps-control -f for 0000:2a:00.0 "
                                           r"\(0b7f8e7c-5555-4c1b-9a55-00000000000a\): exited at once \(status 7\)"):
        driver.preparer.prepare("default", "a", UID_A)
    assert mounted_under(dirs["state"]) == [] and not Path(dirs["state"], "mps", UID_A).exists()


def test_a_daemon_of_the_previous_layout_is_named_and_left_to_its_pods(dirs: dict[str, str],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """An upgrade: daemons.json in the previous shape (GPU -> holders) and that GPU's daemon running. It is not
    adopted as a claim's (its pods' specs name its directory), not killed under them, and named in a warning;
    the record is rewritten in the new shape."""
    import subprocess

    pipe = Path(dirs["state"], "mps", ADDRESS, "pipe")
    for directory in (pipe, pipe.parent / "log"):
        directory.mkdir(parents=True)
    control = str(Path(dirs["driver"], "usr/bin/nvidia-cuda-mps-control"))
    old = subprocess.Popen([control, "-f"], env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                                 "CUDA_MPS_LOG_DIRECTORY": str(pipe.parent / "log")})
    try:
        deadline = time.monotonic() + 30
        while not (pipe / "control").exists():
            assert old.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        record = Path(dirs["state"], "mps", "daemons.json")
        record.write_text(json.dumps({ADDRESS: {"pid": old.pid, "start_time": 1, "holders": [UID_A]}}))
        daemons = MpsDaemons(dirs["state"], dirs["driver"])
        assert daemons.check() == []
        assert f"MPS daemon pid {old.pid} (pipe {pipe}) is of the previous layout" in caplog.text
        assert old.poll() is None and json.loads(record.read_text()) == {} and daemons.running() == {}
    finally:
        old.kill()
        old.wait()


def test_a_removed_control_socket_is_a_daemon_not_serving(dirs: dict[str, str]) -> None:
    driver = packed(dirs)
    driver.preparer.prepare("default", "a", UID_A)
    before = record(dirs, UID_A)
    Path(pipe_of(dirs, UID_A), "control").unlink()  # nothing there: a client would fall back to the bare GPU
    Path(dirs["state"], "mps", "daemons.json").write_text("{")  # and the record lost: found with no socket
    assert MpsDaemons(dirs["state"], dirs["driver"]).running() == {}
    driver.preparer.rebook()
    assert record(dirs, UID_A)["pid"] != before["pid"] and Path(pipe_of(dirs, UID_A), "control").exists()
