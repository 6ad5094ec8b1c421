"""Sharing through a DRA claim on the fake HGX host, over the driver's real socket: a claim's GpuConfig chooses
TimeSlicing or MPS (a claim without config stays exclusive; a bad field is the claim's error and leaves
nothing), and MPS runs one control daemon per claim through the driver root's `nvidia-cuda-mps-control` (here a
stand-in script that behaves as the real one does to the driver: `-f` serves until `quit` arrives on its
stdin): started on the first claim, stopped on the last, started again after a crash, adopted by a restarted
driver, nothing left behind; the claim's CDI device carries CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY,
the limits and the daemon's directories. Each claim has its own daemon on its own tmpfs: two claims on one GPU
never share a pipe directory, a replaced `control` socket is found and its daemon started again, and a pod
filling its pipe directory fills its own tmpfs, not the state dir."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.agent.mps import MpsDaemons
from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Ledger
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, FakeApi, cdi_files, make_driver, prepare, unprepare

STAND_IN = """#!/bin/sh
# nvidia-cuda-mps-control, as the driver drives it: `-f` serves in the foreground; a command on stdin
# (`quit`) is sent to the daemon of CUDA_MPS_PIPE_DIRECTORY
if [ "$1" = "-f" ]; then
    echo "$CUDA_VISIBLE_DEVICES" > "$CUDA_MPS_PIPE_DIRECTORY/visible"
    echo started >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
    : > "$CUDA_MPS_PIPE_DIRECTORY/control"
    while [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/quit" ]; do sleep 0.02; done
    exit 0
fi
read -r command
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || exit 1
[ "$command" = quit ] && : > "$CUDA_MPS_PIPE_DIRECTORY/quit"
"""

GPU = "0000:18:00.0"
OTHER_GPU = "0000:2a:00.0"


def gpu_config(**sharing: object) -> list[dict[str, object]]:
    return [{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": sharing}}}]


MPS = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "4Gi"}}


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state", "driver")}
    os.makedirs(out["state"], mode=0o755)
    control = Path(out["driver"], "usr/bin/nvidia-cuda-mps-control")
    control.parent.mkdir(parents=True)
    control.write_text(STAND_IN)
    control.chmod(0o755)
    return out


def started(dirs: dict[str, str], api: FakeApi) -> DraDriver:
    driver = make_driver(dirs, api)
    driver.preparer.mps = MpsDaemons(dirs["state"], driver_root=dirs["driver"])
    driver.start()
    driver.refresh()
    return driver


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def driver(dirs: dict[str, str], api: FakeApi) -> Iterator[DraDriver]:
    d = started(dirs, api)
    yield d
    d.servers.stop()
    kill_stand_ins(dirs["driver"])
    unmount_under(dirs["state"])


def kill_stand_ins(driver_root: str) -> None:
    """No stand-in control daemon outlives its test: each test asserts the daemons it expects gone, but one a
    failing (or, on a loaded machine, a slow) test left would run on after the session."""

    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(driver_root.encode()) for a in args):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def unmount_under(directory: str) -> None:
    """No daemon's tmpfs outlives its test (a failing test may leave one mounted)."""
    from devinject.linux import syscalls

    for point in sorted(mounted_under(directory), reverse=True):
        with contextlib.suppress(OSError):
            syscalls.umount(point)


def daemon_pid(dirs: dict[str, str], holder: str) -> int | None:
    """The pid of `holder`'s (a claim's UID) daemon, as recorded."""
    try:
        data = json.loads(Path(dirs["state"], "mps", "daemons.json").read_text())
    except FileNotFoundError:
        return None
    return next((e["pid"] for e in data.values() if e["holder"] == holder), None)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def mounted_under(directory: str) -> list[str]:
    """The mount points under `directory` (a daemon's tmpfs left behind would be one)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        points = [line.split()[4] for line in handle]
    return [p for p in points if p.startswith(directory.rstrip("/") + "/")]


def claim_spec(dirs: dict[str, str], uid: str) -> dict[str, object]:
    return json.loads(Path(dirs["cdi"], f"{DRIVER}-{uid}.json").read_text())  # type: ignore[no-any-return]


def test_a_claim_without_config_stays_exclusive_and_time_slicing_is_recorded(driver: DraDriver, api: FakeApi,
                                                                               dirs: dict[str, str]) -> None:
    api.add("plain", "uid-plain", [(GPU_POOL, "gpu-0000-18-00-0")])
    api.add("sliced", "uid-sliced", [(GPU_POOL, "gpu-0000-2a-00-0")],
            config=gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"}))
    answer = prepare(driver, ("plain", "uid-plain"), ("sliced", "uid-sliced"))
    assert answer.claims["uid-plain"].error == "" and answer.claims["uid-sliced"].error == ""
    checkpoint = driver.preparer.prepared()
    assert checkpoint["uid-plain"].sharing == {} and checkpoint["uid-plain"].mps == {}
    assert checkpoint["uid-sliced"].sharing == {"gpus": {"strategy": "TimeSlicing", "interval": "Short"}}
    env = claim_spec(dirs, "uid-sliced")["devices"][0]["containerEdits"].get("env", [])  # type: ignore[index]
    assert not [e for e in env if e.startswith("CUDA_MPS")]  # no daemon for time-slicing
    assert daemon_pid(dirs, "uid-sliced") is None
    unprepare(driver, ("plain", "uid-plain"), ("sliced", "uid-sliced"))
    assert cdi_files(dirs) == []


def test_mps_starts_a_daemon_on_the_first_claim_and_gives_the_container_its_pipe(driver: DraDriver, api: FakeApi,
                                                                                dirs: dict[str, str]) -> None:
    api.add("mps", "uid-mps", [(GPU_POOL, "gpu-0000-18-00-0")], config=gpu_config(**MPS))
    answer = prepare(driver, ("mps", "uid-mps"))
    assert answer.claims["uid-mps"].error == ""
    pid = daemon_pid(dirs, "uid-mps")
    assert alive(pid)
    top = Path(dirs["state"], "mps", "uid-mps")  # the claim's own daemon, on its own tmpfs
    assert (top / "pipe" / "control").exists() and (top / "log" / "control.log").read_text() == "started\n"
    assert (top / "pipe" / "visible").read_text().startswith("GPU-5b3c0a1e")  # the GPU, as the daemon names it
    assert all(os.stat(top / d).st_uid == 0 and os.stat(top / d).st_mode & 0o022 == 0 for d in ("pipe", "log"))
    edits = claim_spec(dirs, "uid-mps")["devices"][0]["containerEdits"]  # type: ignore[index]
    assert {"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M"} <= set(edits["env"])
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    assert mounts["/tmp/nvidia-mps"] == str(top / "pipe") and mounts["/var/log/nvidia-mps"] == str(top / "log")
    options = {m["containerPath"]: m["options"] for m in edits["mounts"]}
    assert "ro" in options["/var/log/nvidia-mps"] and "rw" not in options["/var/log/nvidia-mps"]  # the daemon's
    assert {"nosuid", "nodev", "noexec"} <= set(options["/tmp/nvidia-mps"])
    assert os.stat(top).st_dev != os.stat(dirs["state"]).st_dev  # a filesystem apart from the state dir
    # the claim gone: its daemon quit, its tmpfs with it
    assert unprepare(driver, ("mps", "uid-mps")).claims["uid-mps"].error == ""
    assert not alive(pid) and not top.exists() and daemon_pid(dirs, "uid-mps") is None
    assert not mounted_under(dirs["state"])
    assert cdi_files(dirs) == []


def test_a_crashed_daemon_starts_again_and_a_restarted_driver_adopts_it(driver: DraDriver, api: FakeApi,
                                                                        dirs: dict[str, str]) -> None:
    api.add("mps", "uid-mps", [(GPU_POOL, "gpu-0000-18-00-0")], config=gpu_config(**MPS))
    prepare(driver, ("mps", "uid-mps"))
    first = daemon_pid(dirs, "uid-mps")
    assert first is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(first) and time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            os.waitpid(first, os.WNOHANG)
        except ChildProcessError:
            pass
    driver.refresh()  # the driver's round
    second = daemon_pid(dirs, "uid-mps")
    assert second != first and alive(second)
    driver.servers.stop()
    again = started(dirs, api)  # a restart: the running daemon is kept, not a second one started
    try:
        assert daemon_pid(dirs, "uid-mps") == second and alive(second)
        assert unprepare(again, ("mps", "uid-mps")).claims["uid-mps"].error == ""
        assert not alive(second) and not Path(dirs["state"], "mps", "uid-mps").exists()
    finally:
        again.servers.stop()


@pytest.mark.parametrize(("case", "expected"), [
    ("strategy", "config[0].opaque: sharing.strategy: expected TimeSlicing or MPS, got 'Spatial'"),
    ("two-gpus", "MPS on 2 GPUs in one claim"),
    ("no-control", "nvidia-cuda-mps-control: the driver's MPS control program is not there"),
])
def test_a_sharing_claim_that_cannot_be_prepared_leaves_nothing(driver: DraDriver, api: FakeApi,
                                                                dirs: dict[str, str], case: str,
                                                                expected: str) -> None:
    devices = [(GPU_POOL, "gpu-0000-18-00-0")]
    config = gpu_config(**MPS)
    if case == "strategy":
        config = gpu_config(strategy="Spatial")
    elif case == "two-gpus":
        devices.append((GPU_POOL, "gpu-0000-2a-00-0"))
    else:
        Path(dirs["driver"], "usr/bin/nvidia-cuda-mps-control").unlink()
    api.add("bad", "uid-bad", devices, config=config)
    answer = prepare(driver, ("bad", "uid-bad")).claims["uid-bad"]
    assert expected in answer.error and "claim default/bad" in answer.error and not answer.devices
    assert cdi_files(dirs) == [] and driver.preparer.prepared() == {}
    assert "dra-claim" not in json.dumps(Ledger(dirs["state"]).snapshot())
    assert daemon_pid(dirs, "uid-bad") is None and not Path(dirs["state"], "mps", "uid-bad").exists()
    assert not mounted_under(dirs["state"])


def test_a_broken_daemon_record_finds_the_running_daemon_again(driver: DraDriver, api: FakeApi,
                                                               dirs: dict[str, str]) -> None:
    """daemons.json corrupt: the daemon running from our pipe directory is found in /proc and adopted (no
    second daemon over its pipe), serving the checkpoint's claim again; unprepared, it stops."""
    api.add("mps", "uid-mps", [(GPU_POOL, "gpu-0000-18-00-0")], config=gpu_config(**MPS))
    prepare(driver, ("mps", "uid-mps"))
    pid = daemon_pid(dirs, "uid-mps")
    record = Path(dirs["state"], "mps", "daemons.json")
    control = os.stat(Path(dirs["state"], "mps", "uid-mps", "pipe", "control")).st_ino
    record.write_text('{"uid-mps": {"pid": "x"')
    driver.refresh()
    assert daemon_pid(dirs, "uid-mps") == pid and alive(pid)
    entry = json.loads(record.read_text())["uid-mps"]
    assert entry["holder"] == "uid-mps" and entry["gpu"] == GPU and entry["visible"].startswith("GPU-")
    assert entry["control"][1] == control  # its socket, as the daemon made it
    assert unprepare(driver, ("mps", "uid-mps")).claims["uid-mps"].error == ""
    assert not alive(pid) and not Path(dirs["state"], "mps", "uid-mps").exists()


def test_a_daemon_no_prepared_claim_needs_is_stopped(driver: DraDriver, api: FakeApi, dirs: dict[str, str]) -> None:
    """A crash between the steps (the daemon started, the checkpoint lost): the driver's round stops it."""
    api.add("mps", "uid-mps", [(GPU_POOL, "gpu-0000-18-00-0")], config=gpu_config(**MPS))
    prepare(driver, ("mps", "uid-mps"))
    pid = daemon_pid(dirs, "uid-mps")
    Path(driver.preparer.checkpoint.path).write_text('{"version": 1, "claims": {}}')
    driver.refresh()
    assert not alive(pid) and daemon_pid(dirs, "uid-mps") is None
    assert not Path(dirs["state"], "mps", "uid-mps").exists() and not mounted_under(dirs["state"])
