"""Faults the kernel announces leave the specs as they happen, on the agent's real loop with an interval (and
recheck) of 60 s: a fatal Xid appended to the kernel log, a PCI unbind or remove uevent fed to the loop's
uevent entry point as the listener thread does. The waits are for the loop's state, bounded only so a broken
agent fails instead of hanging; nothing here asserts a duration. Polled readings keep `--threshold`: a single
noisy AER reading never takes a device out, on a round or on an announced check."""

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.agent.watch import Watcher, WatchOptions, announced_address
from tests.unit.test_kernel_log import with_kernel_log
from tests.unit.test_watch import GPU, _gpu_names, _running, _wait_for, options

SLOW = {"interval": 60.0, "recheck": 60.0, "rescan": 3600.0}
UNBIND = {"ACTION": "unbind", "SUBSYSTEM": "pci", "DRIVER": "nvidia", "PCI_SLOT_NAME": "0000:18:00.0",
          "DEVPATH": "/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"}


@pytest.fixture
def slow_agent(host_copy, tmp_path):
    root = host_copy("hgx-h100")
    with_kernel_log(root)
    return WatchOptions(**{**options(root, tmp_path).__dict__, **SLOW}), root, tmp_path


def events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]


def started(tmp_path: Path) -> bool:
    """The loop's first round is done: it waits for the next (in 60 s)."""
    path = tmp_path / "state" / "events.jsonl"
    return path.exists() and any(e["event"] == "watch-started" for e in events(tmp_path))


def test_an_xid_line_appended_to_the_kernel_log_takes_the_gpu_out_between_rounds(slow_agent):
    opts, root, tmp_path = slow_agent
    with _running(opts):
        assert _wait_for(lambda: started(tmp_path))
        with open(root / "var/log/kern.log", "a") as handle:
            handle.write("Jan 1 00:00:01 node kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=0, "
                         "GPU has fallen off the bus.\n")
        assert _wait_for(lambda: "0" not in _gpu_names(tmp_path))
        assert "1" in _gpu_names(tmp_path)
    out = [e for e in events(tmp_path) if e["event"] == "taken-out"]
    assert [e["device"] for e in out] == ["nvidia.com/gpu=0000:18:00.0"] and out[0]["at_once"] is True


def test_an_unbind_uevent_takes_the_gpu_out_between_rounds(slow_agent):
    opts, root, tmp_path = slow_agent
    with _running(opts) as w:
        assert _wait_for(lambda: started(tmp_path))
        (root / GPU / "driver").unlink()
        w.uevent(UNBIND)
        assert _wait_for(lambda: "0" not in _gpu_names(tmp_path))
        assert "1" in _gpu_names(tmp_path)


def test_an_announced_check_of_a_healthy_device_changes_nothing(slow_agent):
    """A uevent is a hint to look, not a verdict: a device that checks healthy (a rebind raced the event)
    stays, and an unrelated line in the log checks nothing."""
    opts, root, tmp_path = slow_agent
    w = Watcher(opts)
    w.rescan()
    w.check()
    w.write()
    assert not w.check_announced(frozenset({"0000:18:00.0"}))
    with open(root / "var/log/kern.log", "a") as handle:
        handle.write("NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception\n")  # not fatal
    assert not w.check_announced()
    assert "0" in _gpu_names(tmp_path)


def test_a_single_noisy_aer_reading_does_not_take_a_device_out(slow_agent):
    """AER fatal 0 -> 1 read once, then back: one failed round, not three; and an announced check of the same
    device in the meantime (a uevent naming it) neither takes it out nor counts as a round."""
    opts, root, tmp_path = slow_agent
    aer = root / GPU / "aer_dev_fatal"
    w = Watcher(opts)
    w.rescan()
    w.check()
    w.write()
    aer.write_text("ERR_FATAL 0\nTOTAL_ERR_FATAL 1\n")
    assert not w.check()
    assert not w.check_announced(frozenset({"0000:18:00.0"}))
    assert w.tracks["nvidia.com/gpu=0000:18:00.0"].fails == 1
    aer.write_text("ERR_FATAL 0\nTOTAL_ERR_FATAL 0\n")  # the noisy reading is gone
    assert not any(w.check() for _ in range(5))
    assert "0" in _gpu_names(tmp_path)
    assert "taken-out" not in [e["event"] for e in events(tmp_path)]


def test_polled_faults_still_need_threshold_checks(slow_agent):
    opts, root, tmp_path = slow_agent
    w = Watcher(opts)
    w.rescan()
    w.check()
    (root / GPU / "aer_dev_fatal").write_text("ERR_FATAL 0\nTOTAL_ERR_FATAL 1\n")
    assert [w.check() for _ in range(3)] == [False, False, True]
    (root / GPU / "driver").unlink()  # the kernel's statement: at the first check
    w2 = Watcher(replace(opts, state_dir=str(tmp_path / "other")))
    w2.rescan()
    assert w2.check() is True


@pytest.mark.parametrize(("message", "address"), [
    (UNBIND, "0000:18:00.0"),
    ({**UNBIND, "ACTION": "remove", "PCI_SLOT_NAME": ""}, "0000:18:00.0"),  # from DEVPATH
    ({**UNBIND, "ACTION": "bind"}, None),
    ({**UNBIND, "ACTION": "change"}, None),
    ({**UNBIND, "SUBSYSTEM": "drm"}, None),
    (object(), None),
], ids=["unbind", "remove", "bind", "change", "other-subsystem", "not-a-message"])
def test_which_uevents_announce_a_fault(message, address):
    assert announced_address(message) == address


def test_take_out_and_put_back_are_said_at_info_with_the_device_and_the_reason(slow_agent, caplog):
    opts, root, tmp_path = slow_agent
    w = Watcher(opts)
    w.rescan()
    w.check()
    w.write()
    enable = root / GPU / "enable"
    with caplog.at_level(logging.INFO, logger="devinject"):
        enable.write_text("0\n")
        for _ in range(3):
            w.check()
        enable.write_text("1\n")
        for _ in range(3):
            w.check()
        (root / GPU / "driver").unlink()
        w.check_announced(frozenset({"0000:18:00.0"}))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "nvidia.com/gpu=0" in
            r.getMessage()]
    assert said == [
        "taking out nvidia.com/gpu=0 (PCI 0000:18:00.0): PCI function disabled (enable=0) "
        "(after 3 failed checks in a row)",
        "putting back nvidia.com/gpu=0 (PCI 0000:18:00.0): healthy again, 3 checks passed in a row",
        "taking out nvidia.com/gpu=0 (PCI 0000:18:00.0): driver unbound (at once: the kernel's own statement)",
    ]


def test_a_chatty_kernel_log_does_not_rewrite_the_state_file_on_every_line(slow_agent):
    """Unrelated kernel messages wake the loop each time the log grows; the persisted state (fsynced) is left
    for the next round unless a device was checked."""
    opts, root, tmp_path = slow_agent
    w = Watcher(opts)
    w.rescan()
    w.check()
    state = tmp_path / "state" / "health-state.json"
    before = state.stat().st_ino
    for i in range(5):
        with open(root / "var/log/kern.log", "a") as handle:
            handle.write(f"Jan 1 00:00:0{i} node kernel: eth0: link up\n")
        assert not w.check_announced()
    assert state.stat().st_ino == before
