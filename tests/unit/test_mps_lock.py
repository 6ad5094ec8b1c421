"""Two agents on one node (the device plugin and the DRA driver) each keep MPS daemons in the same
daemons.json: each read-modify-write is under one lock, so neither forgets the other's daemon."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from devinject.agent import mps
from devinject.agent.mps import MpsDaemons
from devinject.nodestate.ledger import process_start_time


def slow_start(self: MpsDaemons, daemon: mps.Daemon, gpu: str, visible: str) -> dict[str, object]:
    """A daemon 'started' in 0.3 s (this process stands in for it, so it is alive): the window in which a
    second writer that read the record before this one saves it would lose this entry."""
    time.sleep(0.3)
    return {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "visible": visible, "control": None}


def test_two_agents_starting_daemons_at_once_both_stay_recorded(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MpsDaemons, "_start", slow_start)
    state = str(tmp_path / "state")
    plugin, driver = MpsDaemons(state), MpsDaemons(state)  # two processes' views: nothing shared in memory
    threads = [threading.Thread(target=plugin.acquire, args=("0000:01:00.0", "device-plugin:a", "0")),
               threading.Thread(target=driver.acquire, args=("0000:02:00.0", "claim-b", "1"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    recorded = json.loads((tmp_path / "state" / "mps" / "daemons.json").read_text())
    assert sorted(e["gpu"] for e in recorded.values()) == ["0000:01:00.0", "0000:02:00.0"]
    assert MpsDaemons(state).recorded() == {"0000:01:00.0": ["device-plugin:a"], "0000:02:00.0": ["claim-b"]}


def test_a_lock_held_too_long_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    monkeypatch.setattr(mps, "LOCK_TIMEOUT", 0.2)
    state = tmp_path / "state"
    (state / "mps").mkdir(parents=True, mode=0o755)
    with open(state / "mps" / mps.LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(mps.MpsError, match=r"daemons.lock: the MPS daemons lock was not free within 0.2s"):
            MpsDaemons(str(state)).acquire("0000:01:00.0", "claim-a", "0")


def test_a_node_that_never_ran_a_daemon_checks_nothing(tmp_path: Path) -> None:
    assert MpsDaemons(str(tmp_path / "state")).check() == []
    assert not (tmp_path / "state").exists()  # no dir made, no /proc walk at every round


@pytest.mark.parametrize("holder", ["0b7f8e7c-5555-4c1b-9a55-00000000000a", "daemons.json", ".daemons.lock", "..",
                                    "device-plugin:nvidia.com/gpu:0000:18:00.0::3", "x/../y", "a" * 300, "ü"])
def test_a_holders_daemon_directory_is_one_plain_name_of_its_own(holder: str) -> None:
    """A claim's UID is its daemon's directory; anything else (the plugin's holders have `/` and `:`) is made
    plain and told apart by a digest: never a path, a dot file (the lock), or another holder's name."""
    name = mps.daemon_name(holder)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name) and name not in (mps.STATE, mps.LOCK), name
    assert name == holder or name != mps.daemon_name(holder + "x")
    assert MpsDaemons("/state").daemon(holder).top == f"/state/mps/{name}"


def test_a_holder_is_needed() -> None:
    with pytest.raises(mps.MpsError, match="an MPS daemon needs a holder"):
        mps.daemon_name("")
