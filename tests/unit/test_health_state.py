"""Verdicts outlive the agent: a restart of `watch` / `device-plugin` (same state dir) never puts a failing
device back; re-enumeration or an admin's put-back clears a sticky verdict; a persisted state that is not to be
believed holds devices out instead of letting them in. Driven round by round on a fixture copy."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.agent import healthstate
from devinject.agent.watch import Watcher, WatchOptions
from devinject.cdi.spec import load_file
from tests.unit.test_watch import options

GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
# the second GPU in bus order (index 1) is 0000:2a:00.0
KEY = "nvidia.com/gpu=0000:18:00.0"
DEVINJECT = str(Path(sys.executable).parent / "devinject")


@pytest.fixture
def agent(host_copy, tmp_path):
    root = host_copy("hgx-h100")
    return options(root, tmp_path), root, tmp_path


def start(opts: WatchOptions) -> Watcher:
    """What `Watcher.run` does before its loop: a new agent process, as after a restart."""
    w = Watcher(opts)
    w.rescan()
    w.check()
    w.write()
    return w


def rounds(w: Watcher, n: int) -> list[bool]:
    out = []
    for _ in range(n):
        changed = w.check()
        if changed:
            w.write()
        out.append(changed)
    return out


def gpu_names(tmp_path: Path) -> set[str]:
    spec = tmp_path / "cdi" / "nvidia.com-gpu.yaml"  # a kind with no device offered has no spec
    return {d.name for d in load_file(spec).devices} if spec.exists() else set()


def events(tmp_path: Path, device: str | None = KEY) -> list[str]:
    lines = (tmp_path / "state" / "events.jsonl").read_text().splitlines()
    return [e["event"] for e in map(json.loads, lines) if device is None or e.get("device") == device]


def health(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "state" / "health.json").read_text())


def set_fatal(root: Path, count: int, gpu: str = GPU) -> None:
    (root / gpu / "aer_dev_fatal").write_text(f"ERR_FATAL 0\nTOTAL_ERR_FATAL {count}\n")


def taken_out_by_aer(opts, root, tmp_path) -> Watcher:
    w = start(opts)
    set_fatal(root, 1)
    assert rounds(w, 3) == [False, False, True]
    assert "0" not in gpu_names(tmp_path)
    return w


def test_aer_fatal_verdict_survives_a_restart(agent):
    """The issue's reproduction: 0 -> 1, taken out; a new process with the same state dir used to take 1 as its
    baseline and offer the GPU again within two rounds, with health.json healthy and no put-back event."""
    opts, root, tmp_path = agent
    taken_out_by_aer(opts, root, tmp_path)
    w = start(opts)  # the restart: a DaemonSet rollout, a crash
    assert "0" not in gpu_names(tmp_path)
    assert rounds(w, 10) == [False] * 10
    assert "0" not in gpu_names(tmp_path)
    device = health(tmp_path)["devices"][KEY]
    assert device["published"] == "unhealthy" and device["status"] == "unhealthy"
    assert any("AER fatal errors 0 -> 1" in r for r in device["reasons"]), device
    assert "c 195:2" in health(tmp_path)["unhealthy_nodes"]
    assert "put-back" not in events(tmp_path) and events(tmp_path).count("taken-out") == 1


def test_a_device_taken_out_is_out_from_the_first_write_after_a_restart(agent):
    """A device out for a live reading (enable=0) is not offered for `threshold` rounds after a restart."""
    opts, root, tmp_path = agent
    w = start(opts)
    (root / GPU / "enable").write_text("0\n")
    rounds(w, 3)
    start(opts)
    assert "0" not in gpu_names(tmp_path) and "c 195:2" in health(tmp_path)["unhealthy_nodes"]


def test_a_device_that_recovered_while_the_agent_was_down_goes_back_after_threshold(agent):
    opts, root, tmp_path = agent
    w = start(opts)
    (root / GPU / "enable").write_text("0\n")
    rounds(w, 3)
    (root / GPU / "enable").write_text("1\n")  # fixed while no agent ran
    w = start(opts)
    assert "0" not in gpu_names(tmp_path)
    assert rounds(w, 2) == [False, True]  # with the start's own check: three passes
    assert "0" in gpu_names(tmp_path) and events(tmp_path)[-1] == "put-back"


def test_fatal_xids_read_before_and_logged_during_a_restart_still_count(agent):
    opts, root, tmp_path = agent
    log = root / "var/log/kern.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("boot\n")
    w = start(opts)
    with open(log, "a") as handle:
        handle.write("NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n")
    rounds(w, 3)
    assert "0" not in gpu_names(tmp_path)
    with open(log, "a") as handle:  # no agent runs: GPU 1 fails meanwhile
        handle.write("NVRM: Xid (PCI:0000:2a:00): 48, DBE\n")
    w = start(opts)
    rounds(w, 5)
    assert {"0", "1"}.isdisjoint(gpu_names(tmp_path)) and "2" in gpu_names(tmp_path)


def test_an_admin_put_back_clears_the_verdict_and_a_new_fault_counts_again(agent):
    opts, root, tmp_path = agent
    w = taken_out_by_aer(opts, root, tmp_path)
    key, accepted = healthstate.request_put_back(str(root), opts.state_dir, "nvidia.com/gpu=0")
    assert key == KEY and accepted == {"0000:18:00.0": (1, 0)}
    assert rounds(w, 3) == [False, False, True]  # judged afresh: back after three passes
    assert "0" in gpu_names(tmp_path)
    assert events(tmp_path)[-4:] == ["put-back-requested", "cleared", "healthy", "put-back"]
    set_fatal(root, 2)  # the accepted total is the new baseline: 1 -> 2 is a new fault
    assert rounds(w, 3) == [False, False, True] and "0" not in gpu_names(tmp_path)
    start(opts)  # and the accepted baseline survives a restart too
    assert "0" not in gpu_names(tmp_path)


def test_a_put_back_accepts_only_the_totals_the_admin_saw(agent):
    opts, root, tmp_path = agent
    w = taken_out_by_aer(opts, root, tmp_path)
    healthstate.request_put_back(str(root), opts.state_dir, KEY)
    set_fatal(root, 2)  # before the agent takes the request
    rounds(w, 6)
    assert "0" not in gpu_names(tmp_path)


def test_a_put_back_asked_while_no_agent_runs_is_taken_when_one_starts(agent):
    opts, root, tmp_path = agent
    taken_out_by_aer(opts, root, tmp_path)
    healthstate.request_put_back(str(root), opts.state_dir, "0000:18:00.0")
    w = start(opts)
    assert "0" not in gpu_names(tmp_path)  # still only after `threshold` passes
    assert rounds(w, 2) == [False, True] and "0" in gpu_names(tmp_path)
    assert not (tmp_path / "state" / healthstate.REQUESTS_FILE).exists()  # taken once


def test_put_back_command(agent):
    opts, root, tmp_path = agent
    taken_out_by_aer(opts, root, tmp_path)
    done = subprocess.run([DEVINJECT, "put-back", "--root", str(root), "--state-dir", opts.state_dir,
                           "nvidia.com/gpu=0000:18:00.0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "put-back requested" in done.stdout and "fatal 1" in done.stdout, done
    wrong = subprocess.run([DEVINJECT, "put-back", "--root", str(root), "--state-dir", opts.state_dir,
                            "nvidia.com/gpu=77"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and wrong.stderr.strip().splitlines() == [
        f"devinject: error: nvidia.com/gpu=77: no such device under {root}; did you mean nvidia.com/gpu=7 or "
        "nvidia.com/gpu=6 or nvidia.com/gpu=5?"]  # the closest names, for a typo


def replace_function(root: Path, gpu: str = GPU) -> None:
    """Remove the function and find it again: a new sysfs directory (inode), AER totals back at zero. The new
    one is made before the old goes, so the file system cannot hand out the old inode number again."""
    path = root / gpu
    fresh = path.with_name(path.name + ".new")
    shutil.copytree(path, fresh, symlinks=True)
    set_fatal(root, 0, gpu + ".new")
    shutil.rmtree(path)
    fresh.rename(path)


def test_re_enumeration_clears_the_verdict(agent):
    opts, root, tmp_path = agent
    w = taken_out_by_aer(opts, root, tmp_path)
    replace_function(root)
    w.rescan()
    assert rounds(w, 3) == [False, False, True] and "0" in gpu_names(tmp_path)
    assert "cleared" in events(tmp_path)


def test_re_enumeration_while_the_agent_is_down_clears_the_verdict(agent):
    opts, root, tmp_path = agent
    taken_out_by_aer(opts, root, tmp_path)
    replace_function(root)
    w = start(opts)
    assert "0" not in gpu_names(tmp_path)
    assert rounds(w, 2) == [False, True] and "0" in gpu_names(tmp_path)


def test_a_reboot_is_re_enumeration(agent):
    opts, root, tmp_path = agent
    boot_id = root / "proc/sys/kernel/random/boot_id"
    boot_id.parent.mkdir(parents=True)
    boot_id.write_text("11111111-1111-1111-1111-111111111111\n")
    taken_out_by_aer(opts, root, tmp_path)
    boot_id.write_text("22222222-2222-2222-2222-222222222222\n")  # state dir kept on disk across the reboot
    set_fatal(root, 0)
    w = start(opts)
    assert rounds(w, 2) == [False, True] and "0" in gpu_names(tmp_path)


def test_a_driver_rebind_is_not_re_enumeration(agent):
    """Unbind and bind again keep the same PCI function (and its AER totals): the verdict stays."""
    opts, root, tmp_path = agent
    w = taken_out_by_aer(opts, root, tmp_path)
    driver = root / GPU / "driver"
    target = os.readlink(driver)
    driver.unlink()
    w.rescan()
    rounds(w, 2)
    driver.symlink_to(target)
    w.rescan()
    rounds(w, 6)
    assert "0" not in gpu_names(tmp_path)


def _garbage(path: Path) -> None:
    path.write_text("{not json")


def _bad_status(path: Path) -> None:
    data = json.loads(path.read_text())
    data["devices"][KEY]["published"] = "fine"
    path.write_text(json.dumps(data))


def _bad_counts(path: Path) -> None:
    data = json.loads(path.read_text())
    data["aer"]["0000:18:00.0"] = ["1", 0]
    path.write_text(json.dumps(data))


def _group_writable(path: Path) -> None:
    path.chmod(0o664)


def _a_link(path: Path) -> None:
    real = path.with_name("elsewhere.json")
    path.rename(real)
    path.symlink_to(real)


def _not_root_s(path: Path) -> None:
    os.chown(path, 65534, 65534)


@pytest.mark.parametrize("damage", [_garbage, _bad_status, _bad_counts, _group_writable, _a_link, _not_root_s],
                         ids=["not-json", "bad-status", "bad-counts", "group-writable", "symlink", "other-owner"])
def test_a_state_file_not_to_be_believed_never_puts_a_failing_gpu_back(agent, damage):
    """Safe default: every device starts out, AER totals count from zero (history counts, as `devinject
    health` judges), and a device goes back only when it passes on that evidence."""
    if damage is _not_root_s and os.geteuid() != 0:
        pytest.skip("chown needs root")
    opts, root, tmp_path = agent
    taken_out_by_aer(opts, root, tmp_path)
    state = tmp_path / "state" / healthstate.STATE_FILE
    damage(state)
    w = start(opts)
    assert gpu_names(tmp_path) == set()  # nothing offered before it passed
    rounds(w, 8)
    names = gpu_names(tmp_path)
    assert "0" not in names and {"1", "2", "7"} <= names
    assert any(p.name.startswith(healthstate.STATE_FILE + ".broken-") for p in state.parent.iterdir())
    assert "health-state-rebuilt" in events(tmp_path, None)
    assert healthstate.load_state(opts.state_dir) is not None  # a fresh, trusted file in its place


def test_a_broken_requests_file_puts_nothing_back(agent):
    opts, root, tmp_path = agent
    w = taken_out_by_aer(opts, root, tmp_path)
    requests = tmp_path / "state" / healthstate.REQUESTS_FILE
    requests.write_text(json.dumps({KEY: {"time": 1, "aer": {"0000:18:00.0": "lots"}}}))
    requests.chmod(0o600)
    rounds(w, 6)
    assert "0" not in gpu_names(tmp_path)
    requests.write_text(json.dumps({KEY: {"time": 1, "aer": {"0000:18:00.0": [1, 0]}}}))
    requests.chmod(0o666)  # well formed, but anyone could have written it
    rounds(w, 6)
    assert "0" not in gpu_names(tmp_path)


def test_state_files_are_written_with_explicit_modes_whatever_the_umask(agent):
    opts, root, tmp_path = agent
    w = start(opts)
    for name in (healthstate.STATE_FILE, "health.json"):
        (tmp_path / "state" / name).unlink()
    old = os.umask(0)
    try:
        set_fatal(root, 1)
        rounds(w, 3)
        healthstate.request_put_back(str(root), opts.state_dir, KEY)
    finally:
        os.umask(old)
    state = tmp_path / "state"
    assert (state / healthstate.STATE_FILE).stat().st_mode & 0o777 == 0o600
    assert (state / healthstate.REQUESTS_FILE).stat().st_mode & 0o777 == 0o600
    assert (state / "health.json").stat().st_mode & 0o777 == 0o644


def test_parse_state_names_the_field():
    good = healthstate.encode_state(healthstate.HealthState(
        {KEY: healthstate.TrackedDevice("nvidia.com/gpu", "0000:18:00.0", "unhealthy", "unhealthy", ("x",),
                                       ("c 195:2",), {"0000:18:00.0": "b:1"})}, {"0000:18:00.0": (0, 0)}, "1:2", 5,
        {"0000:18:00": [79]}))
    assert healthstate.encode_state(healthstate.parse_state(good)) == good
    data = json.loads(good)
    data["devices"][KEY]["nodes"] = "c 195:2"  # a string where the list of nodes belongs
    with pytest.raises(healthstate.Untrusted, match=r"devices\['nvidia.com/gpu=0000:18:00.0'\]\.nodes"):
        healthstate.parse_state(json.dumps(data).encode())
    with pytest.raises(healthstate.Untrusted, match="version"):
        healthstate.parse_state(b'{"version": 2}')
