"""The agent's kernel log follower, driven round by round through `watch` (so each case also runs on an agent
that reads the log another way): appends, a line written in two parts, rotation (renamed, a new file made)
with lines the old file got after the last read, copytruncate, and reads bounded per wake-up."""

from pathlib import Path

import pytest

from devinject.agent import health, kernelmsg
from devinject.agent.watch import Watcher
from devinject.cdi.spec import load_file
from tests.unit.test_watch import options

XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n"
XID_48 = "NVRM: Xid (PCI:0000:2a:00): 48, DBE (0x1,0x2)\n"


def with_kernel_log(root: Path) -> Path:
    """The fixture host with a kernel log that has a line in it already."""
    log = root / "var/log/kern.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("Jan 1 00:00:00 node kernel: boot\n")
    return log


@pytest.fixture
def agent(host_copy, tmp_path):
    root = host_copy("hgx-h100")
    log = with_kernel_log(root)
    w = Watcher(options(root, tmp_path))
    w.rescan()
    w.check()  # notes where the log ends
    w.write()
    return w, log, tmp_path


def names(tmp_path: Path) -> set[str]:
    return {d.name for d in load_file(tmp_path / "cdi" / "nvidia.com-gpu.yaml").devices}


def round_(w: Watcher) -> None:
    """As many checks as any fault needs (--threshold): the log is read at the first."""
    for _ in range(w.opts.threshold):
        if w.check():
            w.write()


def append(log: Path, text: str) -> None:
    with open(log, "a") as handle:
        handle.write(text)


def test_a_line_written_in_two_parts_is_read_whole(agent):
    """The first read found half a line: it used to be parsed (no match) and skipped, and the second half
    alone matched nothing either, so the Xid was lost."""
    w, log, tmp_path = agent
    append(log, XID_79[:24])
    round_(w)
    assert "0" in names(tmp_path)
    append(log, XID_79[24:])
    round_(w)
    assert "0" not in names(tmp_path)


def test_lines_logged_just_before_a_rotation_are_read_from_the_old_file(agent):
    """syslog rotation: kern.log renamed to kern.log.1 and a new kern.log made. What the old file got after
    the agent's last read (the fatal Xid) used to be lost: the new file was read from its start, the old one
    not at all."""
    w, log, tmp_path = agent
    append(log, XID_79)
    log.rename(log.with_name("kern.log.1"))
    log.write_text(XID_48)
    round_(w)
    assert {"0", "1"}.isdisjoint(names(tmp_path)) and "2" in names(tmp_path)


def test_a_log_truncated_in_place_is_read_from_its_start(agent):
    w, log, tmp_path = agent
    append(log, "x" * 200 + "\n")
    round_(w)
    log.write_text(XID_79)  # copytruncate: same file, shorter
    round_(w)
    assert "0" not in names(tmp_path)


def test_the_log_is_followed_across_a_restart_and_a_rotation_meanwhile(agent):
    w, log, tmp_path = agent
    log.rename(log.with_name("kern.log.1"))
    log.write_text(XID_79)
    w = Watcher(w.opts)  # a new agent: the file it read before is not kern.log any more
    w.rescan()
    round_(w)
    assert "0" not in names(tmp_path)


def test_reads_are_bounded_and_the_rest_is_read_next_time(tmp_path, monkeypatch):
    monkeypatch.setattr(kernelmsg, "LOG_READ_MAX", 4096)
    path = tmp_path / "kern.log"
    path.write_text("")
    follower = health.KernelLog(str(path))
    assert follower.read() == b"" and not follower.pending()
    lines = [f"line {i:05d} {'.' * 80}\n" for i in range(200)]
    path.write_text("".join(lines))
    assert follower.pending()
    chunks = []
    while follower.pending():
        chunk = follower.read()
        assert 0 < len(chunk) <= 4096 and chunk.endswith(b"\n")
        chunks.append(chunk)
    assert b"".join(chunks).decode() == "".join(lines) and len(chunks) > 1
    path.write_text("".join(lines) + "partial")  # an unterminated line waits for its end
    assert follower.read() == b"" and not follower.pending()
    with open(path, "a") as handle:
        handle.write(" end\n")
    assert follower.read() == b"partial end\n"


def test_an_endless_line_does_not_stall_the_follower(tmp_path, monkeypatch):
    monkeypatch.setattr(kernelmsg, "LOG_LINE_MAX", 1000)
    path = tmp_path / "kern.log"
    path.write_text("")
    follower = health.KernelLog(str(path))
    follower.read()
    path.write_text("z" * 5000)
    assert follower.read() == b"z" * 5000  # dropped by the parser, not waited for
    with open(path, "a") as handle:
        handle.write(XID_79)
    assert follower.read() == XID_79.encode()
