"""The hook server acts only for a caller in its own pid, mount, user and network namespaces: a runtime in
a nested pid namespace (Docker-in-Docker, kind, a CI runner sharing /run/devinject) hands over an OCI state
whose pid names another process in the server's namespace. Under real runc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, Bundle, container_name

pytestmark = pytest.mark.live
DEVINJECT = str(Path(sys.executable).parent / "devinject")

# A prestart hook that runs before devinject's: it says which pid the container's init has in runc's
# namespace (and when it started), and waits until a decoy holds that pid in the server's namespace.
PLACE_DECOY = r"""
import json, os, sys, time
work = sys.argv[1]
pid = json.load(sys.stdin)["pid"]
with open(f"/proc/{pid}/stat", "rb") as stat:
    start = int(stat.read().rsplit(b")", 1)[1].split()[19])
with open(f"{work}/want.tmp", "w") as want:
    want.write(f"{pid} {start}")
os.rename(f"{work}/want.tmp", f"{work}/want")
deadline = time.monotonic() + 20
while not os.path.exists(f"{work}/ready") and time.monotonic() < deadline:
    time.sleep(0.005)
"""

# Pid 1 of the server's own pid namespace (S): it starts the hook server, then runc in a pid namespace nested
# in S (R, whose pids start at 5000), and puts a decoy (its own mount namespace and device cgroup, denied
# every device) at the S pid that is the container's R pid. It prints what happened to the container and the
# decoy as one JSON object.
NESTED = r"""
import json, os, subprocess, sys, time
from pathlib import Path

devinject, sock, work, bundle, name = sys.argv[1:6]
work = Path(work)


def wait_for(path, what):
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


report = {}
cgroup = Path("/sys/fs/cgroup/devices") / f"{name}-decoy"
with open(work / "server.log", "w") as errors:
    server = subprocess.Popen([devinject, "hook-server", "--socket", sock], stderr=errors)
decoy = runc = None
try:
    wait_for(Path(sock), "the hook server's socket")
    cgroup.mkdir()
    (cgroup / "devices.deny").write_text("a")
    with open(work / "runc.out", "w") as out, open(work / "runc.err", "w") as err:
        runc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                                 f"echo 4999 > /proc/sys/kernel/ns_last_pid && exec runc run {name}"],
                                cwd=bundle, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    wait_for(work / "want", "the container's pid")
    pid, start = map(int, (work / "want").read_text().split())
    report["container"] = {"pid": pid, "start_time": start}
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    decoy = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", "echo ready; exec sleep 120"],
                             stdout=subprocess.PIPE, text=True)
    (cgroup / "cgroup.procs").write_text(str(decoy.pid))
    assert decoy.stdout.readline() == "ready\n"
    (work / "ready").write_text(str(decoy.pid))
    report["returncode"] = runc.wait(60)
    report["stdout"] = (work / "runc.out").read_text()
    report["stderr"] = (work / "runc.err").read_text()
    with open(f"/proc/{decoy.pid}/stat", "rb") as stat:
        decoy_start = int(stat.read().rsplit(b")", 1)[1].split()[19])
    with open(f"/proc/{decoy.pid}/mountinfo") as mountinfo:
        mounts = [line.split()[4] for line in mountinfo if line.split()[4].startswith(bundle)]
    report["decoy"] = {"pid": decoy.pid, "start_time": decoy_start, "mounts": mounts,
                       "devices": (cgroup / "devices.list").read_text()}
finally:
    for process in (decoy, runc):
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
    server.terminate()
    server.wait(10)
    if cgroup.exists():
        cgroup.rmdir()
print(json.dumps(report))
"""


def _nested_run(bundle: Bundle, tmp_path: Path, sock: Path) -> dict[str, object]:
    name = container_name()
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", NESTED, DEVINJECT,
                           str(sock), str(tmp_path), str(bundle.path), name],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def test_a_runtime_in_a_nested_pid_namespace_is_served_in_process_and_the_process_its_pid_names_here_is_untouched(
        bundle: Bundle, tmp_path: Path) -> None:
    sock = Path(f"/tmp/di-ns-{os.getpid()}-{tmp_path.name[-12:]}") / "hook.sock"  # a short socket path
    bundle.use_server(sock)
    bundle.without_poststop()
    place = {"path": sys.executable, "args": [sys.executable, "-c", PLACE_DECOY, str(tmp_path)], "timeout": 30}
    bundle.config["hooks"]["prestart"].insert(0, place)
    bundle.save(["sh", "-c", "stat -c %t:%T /dev/nvidia0 || echo missing"],
                annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    try:
        report = _nested_run(bundle, tmp_path, sock)
    finally:
        if sock.parent.exists():
            for leftover in sock.parent.iterdir():
                leftover.unlink()
            sock.parent.rmdir()
    container, decoy = report["container"], report["decoy"]
    assert isinstance(container, dict) and isinstance(decoy, dict)
    assert decoy["pid"] == container["pid"], "the decoy did not get the container's pid number"
    # the process that pid number names in the server's namespaces: no mounts, no device grant, no node
    assert decoy["mounts"] == [] and decoy["devices"] == "", decoy
    assert not (bundle.rootfs / "dev" / "nvidia0").exists()
    # the container that asked got its device, from the hook run in-process, in the runtime's namespaces
    assert report["returncode"] == 0 and report["stdout"] == "c3:0\n", report
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert record["result"] == "ok" and "server" not in record
    # booked for the container (its own pid namespace, its start time), not for the decoy
    (booking,) = json.loads((bundle.state_dir / "ledger.json").read_text())["allocations"].values()
    assert (booking["pid"], booking["start_time"], booking["own_pid_ns"]) == \
        (container["pid"], container["start_time"], True)
    # the server said why it did not serve
    assert "not in the hook server's namespaces" in (tmp_path / "server.log").read_text()


# In a pid namespace of its own (so ns_last_pid is this test's alone): a client connects and sends a
# request, exits and is reaped, and another process in the server's very namespaces takes its pid number.
REUSED_PID = r"""
import json, os, socket, time
from devinject.hook import server

own = server.namespaces_of("self")
address = f"\0devinject-reuse-{os.getppid()}-{time.monotonic_ns()}"
listener = socket.socket(socket.AF_UNIX)
listener.bind(address)
listener.listen(1)
client = os.fork()
if client == 0:
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(address)
        connection.sendall(b"a request")
    os._exit(0)
conn, _ = listener.accept()
os.waitpid(client, 0)
with open("/proc/sys/kernel/ns_last_pid", "w") as last:
    last.write(str(client - 1))
impostor = os.fork()
if impostor == 0:
    time.sleep(60)
    os._exit(0)
found = {"impostor": impostor == client, "namespaces": server.namespaces_of(impostor) == own}
try:
    os.close(conn.getsockopt(socket.SOL_SOCKET, server.SO_PEERPIDFD))
    found["peer pidfd"] = True
except OSError:
    found["peer pidfd"] = False  # Linux < 6.5
found["refused"] = server.refusal(conn, client, own)
server.SO_PEERPIDFD = -1  # as on Linux < 6.5: a pidfd_open of the pid number
found["refused without SO_PEERPIDFD"] = server.refusal(conn, client, own)
os.kill(impostor, 9)
print(json.dumps(found))
"""


def test_a_process_that_takes_a_gone_peers_pid_is_not_taken_for_it() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", REUSED_PID],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["impostor"] and found["namespaces"], found  # the pid names a process the check would pass
    # the peer's own pidfd says it is gone; a pidfd of the number would name the impostor, but the
    # connection says its peer hung up
    assert found["refused"] == ("pid 2 is gone" if found["peer pidfd"] else "pid 2 hung up"), found
    assert found["refused without SO_PEERPIDFD"] == "pid 2 hung up", found
