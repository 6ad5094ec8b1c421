"""The ledger under real runc: an exclusive device goes to one container at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devinject.nodestate.ledger import process_start_time
from tests.e2e.conftest import Bundle, container_name, node_holder, world_reachable_node

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


def test_without_a_poststop_hook_a_deleted_containers_device_goes_to_the_next(bundle: Bundle) -> None:
    """The default install runs no hook at delete: the next booking finds the holder's process gone and
    reclaims its devices (and says so in the events)."""
    bundle.without_poststop()
    first, second = container_name(), container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    assert _start_detached(bundle, first).returncode == 0
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    refused = bundle.run(second)
    assert refused.returncode != 0 and f"is held by container {first}" in refused.stderr, refused.stderr
    subprocess.run(["runc", "delete", "-f", first], check=True)  # no hook runs
    subprocess.run(["runc", "delete", "-f", second], capture_output=True)
    assert first in json.loads((bundle.state_dir / "ledger.json").read_text())["allocations"]
    allowed = bundle.run(second)
    assert allowed.returncode == 0, allowed.stderr
    assert first not in json.loads((bundle.state_dir / "ledger.json").read_text())["allocations"]
    events = [json.loads(line) for line in (bundle.state_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "container-gone" and e.get("container") == first for e in events)


def _tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under `root` with its mode, size and (for a regular file) its bytes."""
    seen = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        seen[str(path.relative_to(root))] = (st.st_mode, st.st_size, data)
    return seen


def test_a_refused_booking_leaves_the_containers_rootfs_untouched(bundle: Bundle, tmp_path: Path) -> None:
    """A refused booking leaves nothing in the refused container's rootfs: no mount target, directory,
    link or linker cache."""
    holder = container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    assert _start_detached(bundle, holder).returncode == 0
    other = Bundle(tmp_path / "other", bundle.spec_dir, bundle.state_dir)
    other.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    before = _tree(other.rootfs)
    refused = other.run(container_name())
    assert refused.returncode != 0 and f"is held by container {holder}" in refused.stderr, refused.stderr
    assert _tree(other.rootfs) == before
    # and the same request, granted, does leave them
    subprocess.run(["runc", "delete", "-f", holder], check=True)
    granted = other.run(container_name())
    assert granted.returncode == 0, granted.stderr
    after = _tree(other.rootfs)
    assert "etc/ld.so.cache" in after and "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14" in after


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


V2 = "mount --make-rprivate / && mount -t cgroup2 none /sys/fs/cgroup && "


def _runc_v2(bundle: Bundle, command: str) -> subprocess.CompletedProcess[str]:
    """runc on cgroup v2, in a private mount namespace where cgroup2 is mounted on /sys/fs/cgroup (stderr
    to a file: a detached container keeps a pipe open)."""
    errors = bundle.path / "runc-v2.err"
    with open(errors, "w") as err:
        done = subprocess.run(["unshare", "-m", "sh", "-c", V2 + command], cwd=bundle.path,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, "", errors.read_text())


def _pid_of(name: str) -> int:
    return int(json.loads(subprocess.run(["runc", "state", name], capture_output=True, text=True,
                                         check=True).stdout)["pid"])


def test_a_zombie_container_init_does_not_keep_its_gpu(bundle: Bundle) -> None:
    """The container's init is killed but its parent (a subreaper, as a container shim is) has not reaped
    it: a zombie holds nothing, and the next container gets the device."""
    first, second = container_name(), container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    reaper = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, subprocess, sys, time\n"
         "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the init becomes our child\n"
         f"subprocess.run(['runc', 'run', '--detach', {first!r}], stdin=subprocess.DEVNULL,\n"
         "               stdout=subprocess.DEVNULL, check=True)\n"
         "print('started', flush=True)\n"
         "time.sleep(120)  # and never reaps it\n"], cwd=bundle.path, stdout=subprocess.PIPE, text=True)
    try:
        assert reaper.stdout is not None and reaper.stdout.readline().strip() == "started"
        pid = _pid_of(first)
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        else:
            raise AssertionError("the container's init never became a zombie")
        bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
        done = bundle.run(second)
        assert done.returncode == 0, done.stderr
    finally:
        reaper.kill()
        reaper.wait()


@pytest.mark.parametrize("v2", [False, True], ids=["cgroup-v1", "cgroup-v2-ebpf"])
def test_a_corrupt_ledger_is_rebuilt_from_the_running_containers_device_rules(bundle: Bundle, v2: bool) -> None:
    first, second = container_name(), container_name()
    bundle.save(["sleep", "60"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    started = _runc_v2(bundle, f"exec runc run --detach {first}") if v2 else _start_detached(bundle, first)
    assert started.returncode == 0, started.stderr
    try:
        ledger = bundle.state_dir / "ledger.json"
        ledger.write_text(ledger.read_text()[:20])  # truncated, as a full disk or a crash might leave it
        bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
        refused = bundle.run(second, v2=v2)
        assert refused.returncode != 0
        assert f"is held by container recovered: cgroup v{2 if v2 else 1} " in refused.stderr, refused.stderr
        assert list(bundle.state_dir.glob("ledger.json.broken-*"))
        events = [json.loads(line)["event"] for line in (bundle.state_dir / "events.jsonl").read_text().splitlines()]
        assert "ledger-rebuilt" in events
        # The rebuild outlives the refusal that made it: the next start is refused too (it used to find no
        # ledger.json at all, and got the GPU the first container still held).
        subprocess.run(["runc", "delete", "-f", second], capture_output=True)
        third = bundle.run(container_name(), v2=v2)
        assert third.returncode != 0
        assert f"is held by container recovered: cgroup v{2 if v2 else 1} " in third.stderr, third.stderr
        pid = _pid_of(first)
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            if process_start_time(pid) is None:
                break
            time.sleep(0.02)
        again = bundle.run(container_name(), v2=v2)
        assert again.returncode == 0, again.stderr  # the rebuilt booking ended with its process
    finally:
        if v2:
            _runc_v2(bundle, f"runc delete -f {first}")


@pytest.mark.parametrize("v2", [False, True], ids=["cgroup-v1", "cgroup-v2-ebpf"])
def test_an_unprivileged_users_o_path_handle_on_a_gpu_wedges_nothing(bundle: Bundle, v2: bool) -> None:
    """Anyone can `unshare -Urm` and take an O_PATH handle on a GPU node (no permission needed). Before, the
    next ledger rebuild booked that process as the GPU's exclusive holder and refused every container."""
    with world_reachable_node(os.makedev(195, 0)) as node, \
            node_holder(node, cgroup_grants=False, flags=os.O_PATH, uid=65534):  # the host's /dev/nvidia0
        bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
        assert bundle.run(container_name(), v2=v2).returncode == 0
        ledger = bundle.state_dir / "ledger.json"
        ledger.write_text(ledger.read_text()[:20])
        started = bundle.run(container_name(), v2=v2)
        assert started.returncode == 0, started.stderr
        bookings = json.loads(ledger.read_text())["allocations"].values()
        assert not [b for b in bookings if b.get("recovered") and "c 195:0" in b["exclusive"]]
