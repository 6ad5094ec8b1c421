"""The watch agent's decisions, driven round by round on a fixture copy (no sleeping)."""

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from devinject.agent.watch import Watcher, WatchOptions, wants_rescan
from devinject.cdi.spec import load_file, read_generation
from devinject.specs.generate import GenerateOptions
from devinject.specs.sequence import write_specs_generation
from tests.e2e.conftest import require

GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"


def options(root: Path, tmp_path: Path) -> WatchOptions:
    """The agent on a fixture copy: specs in tmp_path/cdi, state in tmp_path/state, threshold 3, no uevents."""
    return WatchOptions(generate=GenerateOptions(root=str(root), hook_path="/usr/bin/devinject"),
                        output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state"), threshold=3,
                        kernel_log="/var/log/kern.log", probe_timeout=0.5, uevents=False)


@pytest.fixture
def watcher(host_copy, tmp_path):
    root = host_copy("hgx-h100")
    opts = options(root, tmp_path)
    w = Watcher(opts)
    w.rescan()
    w.check()
    w.write()
    return w, root, tmp_path


def _gpu_names(tmp_path: Path) -> set[str]:
    return {d.name for d in load_file(tmp_path / "cdi" / "nvidia.com-gpu.yaml").devices}


def _wait_for(condition, timeout: float = 5.0) -> bool:
    started = time.monotonic()
    while not condition() and time.monotonic() - started < timeout:
        time.sleep(0.02)
    return condition()


@contextlib.contextmanager
def _running(opts: WatchOptions):
    """The agent's real loop in a thread, stopped (and joined) however the test ends."""
    stop = threading.Event()
    watcher = Watcher(opts)
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield watcher
    finally:
        stop.set()
        thread.join(5)


def _round(w: Watcher) -> bool:
    changed = w.check()
    if changed:
        w.write()
    return changed


def test_one_glitch_does_not_flap_three_failures_take_device_out_three_passes_put_it_back(watcher):
    w, root, tmp_path = watcher
    width = root / GPU / "enable"
    assert "0" in _gpu_names(tmp_path)
    width.write_text("0\n")
    assert not _round(w)
    width.write_text("1\n")  # a glitch: recovers before the threshold
    assert not _round(w)
    width.write_text("0\n")
    assert [_round(w) for _ in range(3)] == [False, False, True]
    names = _gpu_names(tmp_path)
    assert "0" not in names and "GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00" not in names and "1" in names
    health = json.loads((tmp_path / "state" / "health.json").read_text())
    assert health["unhealthy_nodes"] == ["c 195:2"]
    width.write_text("1\n")
    assert [_round(w) for _ in range(3)] == [False, False, True]
    assert "0" in _gpu_names(tmp_path)
    events = [json.loads(line)["event"] for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    assert events.count("taken-out") == 1 and events.count("put-back") == 1
    assert events.count("unhealthy") == 2 and events.count("healthy") == 2  # the glitch was seen, not acted on
    from devinject.nodestate.events import device_history

    ring = device_history(str(tmp_path / "state"), "nvidia.com/gpu=0000:18:00.0")["nvidia.com/gpu=0000:18:00.0"]
    assert [e["event"] for e in ring][-2:] == ["healthy", "put-back"]


def test_new_xid_counts_but_history_does_not(watcher):
    w, root, tmp_path = watcher
    log = root / "var/log/kern.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("NVRM: Xid (PCI:0000:2a:00): 79, pid=0, GPU has fallen off the bus.\n")  # before it watched
    w.check()  # the watcher notes where the log ends
    with open(log, "a") as handle:
        handle.write("NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n")
    # a fatal Xid is the kernel's statement, not a noisy reading: out at the first check, no rechecks
    assert [_round(w) for _ in range(3)] == [True, False, False]
    assert "0" not in _gpu_names(tmp_path) and "1" in _gpu_names(tmp_path)


def test_generation_increases_only_when_content_changes(watcher):
    w, root, tmp_path = watcher
    spec = tmp_path / "cdi" / "nvidia.com-gpu.yaml"
    first = read_generation(spec.read_text())
    w.write()
    assert read_generation(spec.read_text()) == first  # nothing changed: no rewrite
    (root / GPU / "enable").write_text("0\n")
    for _ in range(3):
        _round(w)
    assert read_generation(spec.read_text()) > first


def test_older_generation_never_replaces_newer(tmp_path):
    spec = tmp_path / "a.yaml"
    write_specs_generation(tmp_path, {spec: "---\nkind: x\n"})
    spec.write_text("---\n# devinject-generation: 99\nkind: newer\n")  # another writer got further
    write_specs_generation(tmp_path, {spec: "---\nkind: older\n"})
    assert "newer" in spec.read_text()


def test_kind_with_no_devices_left_loses_its_spec(watcher):
    w, root, tmp_path = watcher
    for rdma in [f for f in w.found if f.profile.kind == "nvidia.com/rdma"]:
        (root / rdma.pci.sys_path.lstrip("/") / "enable").write_text("0\n")
    for _ in range(3):
        _round(w)
    assert not (tmp_path / "cdi" / "nvidia.com-rdma.yaml").exists()
    assert (tmp_path / "cdi" / "nvidia.com-gpu.yaml").exists()


def test_bundles_follow_take_outs_and_a_stale_bundle_spec_goes_even_after_a_restart(watcher):
    from dataclasses import replace

    w, root, tmp_path = watcher
    bundled = WatchOptions(**{**w.opts.__dict__, "generate": replace(w.opts.generate, bundles=("gpu-nic",))})
    w = Watcher(bundled)
    w.rescan()
    w.check()
    w.write()
    spec = tmp_path / "cdi" / "nvidia.com-gpu-nic.yaml"
    assert {d.name for d in load_file(spec).devices} == {*map(str, range(8)), "numa0", "numa1"}
    nic0 = next(f for f in w.found if f.profile.kind == "nvidia.com/rdma" and f.index == 0)
    (root / nic0.pci.sys_path.lstrip("/") / "enable").write_text("0\n")
    for _ in range(3):
        _round(w)
    gpu0 = next(d for d in load_file(spec).devices if d.name == "0")
    nodes = [n.path for n in gpu0.edits.device_nodes]  # its switch's NIC is out: the next closest (NODE)
    assert "/dev/infiniband/uverbs0" not in nodes and "/dev/infiniband/uverbs1" in nodes
    for rdma in [f for f in w.found if f.profile.kind == "nvidia.com/rdma"]:
        (root / rdma.pci.sys_path.lstrip("/") / "enable").write_text("0\n")
    restarted = Watcher(bundled)  # a new agent process: it never wrote the bundle spec itself
    restarted.rescan()
    for _ in range(3):
        restarted.check()
    restarted.write()
    assert not spec.exists()


def test_run_loop_removes_and_restores_within_detection_time(watcher):
    w, root, tmp_path = watcher
    fast = WatchOptions(**{**w.opts.__dict__, "interval": 0.1, "recheck": 0.05, "rescan": 0.2})
    with _running(fast):
        time.sleep(0.3)
        (root / GPU / "current_link_width").write_text("4\n")  # degraded only: stays in the spec
        (root / GPU / "driver").unlink()  # unbound: unhealthy
        assert _wait_for(lambda: "0" not in _gpu_names(tmp_path))
        (root / GPU / "driver").symlink_to("../../../../../../bus/pci/drivers/nvidia")
        assert _wait_for(lambda: "0" in _gpu_names(tmp_path))


def test_run_loop_frees_what_a_dead_container_held(watcher):
    """No poststop hook by default: the agent's rounds free a dead container's devices before the next
    booking wants them, and leave a live one's alone."""
    import subprocess

    from devinject.cdi.identity import NodeId
    from devinject.nodestate.ledger import Claim, Ledger

    w, _, tmp_path = watcher
    ledger = Ledger(w.opts.state_dir)
    gone = subprocess.Popen(["sleep", "60"])
    ledger.book("gone", gone.pid, (Claim("nvidia.com/gpu=0", (NodeId("c 195:0"),)),))
    ledger.book("alive", os.getpid(), (Claim("nvidia.com/gpu=1", (NodeId("c 195:1"),)),))
    gone.kill()
    gone.wait()
    fast = WatchOptions(**{**w.opts.__dict__, "interval": 0.05, "recheck": 0.05, "rescan": 60})

    def booked() -> set[str]:
        return set(json.loads((tmp_path / "state" / "ledger.json").read_text())["allocations"])

    assert booked() == {"gone", "alive"}
    with _running(fast):
        assert _wait_for(lambda: booked() == {"alive"})


@pytest.mark.live  # a real kernel uevent: root and a tun device
def test_uevents_trigger_a_rescan(watcher):
    """A real kernel uevent (synthetic `change` on a misc device) makes the agent rediscover at once."""
    assert wants_rescan({"SUBSYSTEM": "pci", "ACTION": "add"}) and not wants_rescan({"SUBSYSTEM": "net"})
    require(os.geteuid() == 0 and os.path.exists("/sys/devices/virtual/misc/tun/uevent"),
            "needs root and a misc device (tun) to send a synthetic uevent")
    w, root, tmp_path = watcher
    slow = WatchOptions(**{**w.opts.__dict__, "interval": 3600, "recheck": 3600, "rescan": 3600, "uevents": True})
    with _running(slow):
        time.sleep(0.5)
        assert "8" not in _gpu_names(tmp_path)
        new = root / "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:17:00.0"
        shutil.copytree(root / GPU, new, symlinks=True)  # hot-plug a ninth GPU (same minor file reused below)
        (new / "drm").mkdir(exist_ok=True)
        info = root / "proc/driver/nvidia/gpus/0000:17:00.0/information"
        info.parent.mkdir(parents=True)
        info.write_text("Device Minor: \t 8\n")
        (root / "sys/bus/pci/devices/0000:17:00.0").symlink_to("../../../devices/pci0000:12/0000:12:01.0/"
                                                               "0000:15:00.0/0000:16:00.0/0000:17:00.0")
        with open("/sys/devices/virtual/misc/tun/uevent", "w") as handle:
            handle.write("change")
        assert _wait_for(lambda: "8" in _gpu_names(tmp_path))


def test_watch_writes_exactly_what_generate_produces(nvml_host, tmp_path):
    """One pipeline: the agent's specs are generate's specs for the same host and options — NVML
    enrichment included (the agent used to skip it, and to write an empty hook path); NVML is the stub
    libnvidia-ml built from the host's data (tests/nvmlstub), which knows the UUID procfs no longer gives."""
    from devinject.cdi.spec import dump
    from devinject.specs.generate import generate_specs

    root = nvml_host("hgx-h100")
    info = root / "proc/driver/nvidia/gpus/0000:18:00.0/information"
    info.write_text("".join(line for line in info.read_text().splitlines(keepends=True)
                            if not line.startswith("GPU UUID")))  # only NVML can name this GPU by UUID now
    gen = GenerateOptions(root=str(root), nvml=True)
    opts = WatchOptions(generate=gen, output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state"), threshold=3,
                        kernel_log="/var/log/kern.log", probe_timeout=0.5, uevents=False)
    w = Watcher(opts)
    w.rescan()
    w.check()
    w.write()
    expected = {f"{s.vendor}-{s.device_class}.yaml": dump(s) for s in generate_specs(gen)}
    written = {p.name: "\n".join(line for line in p.read_text().splitlines()
                                 if not line.startswith("# devinject-generation")) + "\n"
               for p in (tmp_path / "cdi").glob("*.yaml")}
    assert written == expected
    assert "GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00" in written["nvidia.com-gpu.yaml"]


def test_an_agent_in_a_pid_namespace_of_its_own_leaves_the_sweep_to_the_hooks(tmp_path, caplog):
    """A DaemonSet pod without hostPID shares /run/devinject with the node's hooks: its sweep used to read
    the node's pids as its own and free every booking. Now it leaves the ledger alone, and says so once."""
    import logging

    from devinject.nodestate.ledger import Claim, Ledger

    ledger = Ledger(str(tmp_path))
    ledger.book("c1", os.getpid(), (Claim("nvidia.com/gpu=0", ("c 195:0",)),), {"nvidia.com/gpu": "exclusive"})
    data = json.loads((tmp_path / "ledger.json").read_text())
    data["pid_namespace"] = "0:1"  # as the node's pid namespace looks from a pod
    (tmp_path / "ledger.json").write_text(json.dumps(data))
    watcher = Watcher.__new__(Watcher)
    watcher.opts = type("Opts", (), {"state_dir": str(tmp_path)})()  # type: ignore[assignment]
    watcher.sweep_left_to_hooks = False
    with caplog.at_level(logging.INFO, logger="devinject"):
        watcher.sweep_ledger()
        watcher.sweep_ledger()
    said = [r for r in caplog.records if "left to the hooks" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert json.loads((tmp_path / "ledger.json").read_text())["allocations"]["c1"]["state"] == "active"
