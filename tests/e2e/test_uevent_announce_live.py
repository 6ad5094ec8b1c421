"""A real netlink uevent reaches the agent's own listener and takes an unbound GPU out at once. The agent runs
in a private network namespace (`unshare -n`): the `unbind` message for the fixture's GPU, in the kernel's
format, is sent to the kernel's multicast group there, so only this agent hears it (udev and every other
listener on the machine live in the host's namespace). Interval and recheck are 60 s: only the announcement
can take the GPU out within the wait."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import require

pytestmark = pytest.mark.live

GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"

AGENT = r"""
import json, os, socket, sys, threading, time
from pathlib import Path
from devinject.agent.watch import Watcher, WatchOptions
from devinject.specs.generate import GenerateOptions

root, work, gpu = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
opts = WatchOptions(generate=GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=("nvidia.com/gpu",)),
                    output_dir=work / "cdi", state_dir=str(work / "state"), interval=60, recheck=60, rescan=3600,
                    threshold=3, uevents=True, probe_timeout=1.0)
watcher, stop = Watcher(opts), threading.Event()
thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
thread.start()
health = work / "state" / "health.json"
deadline = time.monotonic() + 10
while not health.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # the listener is bound
(root / gpu / "driver").unlink()
devpath = "/" + gpu.removeprefix("sys/")
fields = {"ACTION": "unbind", "DEVPATH": devpath, "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:18:00.0", "SEQNUM": "7"}
message = f"unbind@{devpath}\0" + "".join(f"{k}={v}\0" for k, v in fields.items())
sender = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
sender.sendto(message.encode(), (0, 1))
deadline = time.monotonic() + 10
while time.monotonic() < deadline and "c 195:2" not in json.loads(health.read_text())["unhealthy_nodes"]:
    time.sleep(0.05)
stop.set()
thread.join(10)
print(json.dumps(json.loads(health.read_text())["unhealthy_nodes"]))
"""


def test_a_real_unbind_uevent_takes_the_gpu_out_at_once(host_copy, tmp_path: Path) -> None:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare(1)")
    root = host_copy("hgx-h100")
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", AGENT, str(root), str(tmp_path), GPU],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "c 195:2" in json.loads(done.stdout.splitlines()[-1])  # the hook's ledger refuses its node now
    out = [json.loads(line) for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    taken = [e for e in out if e["event"] == "taken-out"]
    assert [e["device"] for e in taken] == ["nvidia.com/gpu=0000:18:00.0"] and taken[0]["at_once"] is True
