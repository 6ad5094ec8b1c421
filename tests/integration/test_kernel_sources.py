"""Kernel messages from wherever the node keeps them (agent/kernelmsg.py): the kernel's ring buffer
(/dev/kmsg, the real one: a node for it made in the fixture host) and the journal (the real journalctl over a
journal file written by systemd-journal-remote with kernel-transport entries), each followed by the agent
with the fast path, resumed after a restart without reading an old Xid again as a new fault (a put-back
stays put back), and read one-shot by `health` honouring put-backs.

Userspace cannot write a kernel-facility record to /dev/kmsg (the kernel makes it LOG_USER), which is why the
reader takes the kernel's alone; the tests that need an Xid from the ring buffer accept the user facility
too (`KERNEL_FACILITIES`), the one thing they change."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from devinject.agent import healthstate, kernelmsg
from devinject.api import Node
from devinject.discovery.host import Host
from tests.e2e.conftest import require
from tests.unit.test_health_state import KEY, gpu_names, rounds, start
from tests.unit.test_watch import options

JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
TAG = uuid.uuid4().hex[:8]  # this run's records, told apart from anything else in the machine's ring buffer


def xid(slot: str = "0000:18:00", code: int = 79) -> str:
    return f"devinject-test-{TAG}: NVRM: Xid (PCI:{slot}): {code}, pid=0, GPU has fallen off the bus."


# --- /dev/kmsg --------------------------------------------------------------------------------------------
def test_kmsg_records_are_parsed_and_only_the_kernels_count():
    assert kernelmsg.parse_kmsg_record(b"6,1234,5678,-;NVRM: Xid (PCI:0000:18:00): 79\n SUBSYSTEM=pci\n") == (
        0, 1234, b"NVRM: Xid (PCI:0000:18:00): 79")
    assert kernelmsg.parse_kmsg_record(b"14,7,1,-,caller=T1;user said\n") == (1, 7, b"user said")
    assert kernelmsg.parse_kmsg_record(b"12,x,1,-;bad") is None
    assert kernelmsg.parse_kmsg_record(b"no header at all\n") is None
    assert kernelmsg.parse_kmsg_record(b"6,9,1,-;two\\x0alines\n") == (0, 9, b"two\\x0alines")  # one line


@pytest.fixture
def kmsg_root(host_copy):
    require(os.geteuid() == 0, "making a /dev/kmsg node in the fixture host and writing to the ring buffer need root")
    root = host_copy("hgx-h100")
    (root / "dev").mkdir(exist_ok=True)
    os.mknod(root / "dev/kmsg", 0o600 | stat.S_IFCHR, os.makedev(1, 11))  # the real ring buffer
    return root


def log_to_kmsg(text: str) -> None:
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, f"<3>{text}\n".encode())  # the kernel gives it LOG_USER: never a kernel record
    finally:
        os.close(fd)


def test_kmsg_reads_on_from_its_sequence_number_and_ignores_userspace(kmsg_root):
    host = Host(str(kmsg_root))
    follower = kernelmsg.open_source(host, "auto")
    assert isinstance(follower, kernelmsg.Kmsg)  # auto: the ring buffer when it opens
    assert follower.read() == b""  # the first look notes where the buffer ends
    identity, first = follower.position()
    assert identity == f"kmsg:{host.read_attr('/proc/sys/kernel/random/boot_id') or '-'}" and first and first > 0
    log_to_kmsg(xid())
    assert follower.pending()
    assert follower.read() == b""  # userspace's record: read past, never taken for the kernel's
    assert follower.position()[1] is not None and follower.position()[1] > first
    assert xid().encode() not in b"".join(m.text for m in follower.messages())


def test_kmsg_follower_resumes_after_a_restart_without_reading_old_records(kmsg_root, monkeypatch):
    monkeypatch.setattr(kernelmsg, "KERNEL_FACILITIES", (0, 1))
    host = Host(str(kmsg_root))
    follower = kernelmsg.open_source(host, "kmsg")
    follower.read()
    log_to_kmsg(xid(code=48))
    assert xid(code=48).encode() in follower.read()
    saved = follower.position()
    follower.close()
    log_to_kmsg(xid(code=79))  # logged while no agent ran
    again = kernelmsg.open_source(host, "kmsg")
    again.resume(*saved)
    lines = again.read()
    assert xid(code=79).encode() in lines and xid(code=48).encode() not in lines  # each once, in order
    assert again.read() == b""


def test_the_agent_on_kmsg_takes_out_puts_back_and_restarts_without_a_second_take_out(kmsg_root, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(kernelmsg, "KERNEL_FACILITIES", (0, 1))
    root = kmsg_root
    opts = options(root, tmp_path)
    opts = type(opts)(**{**opts.__dict__, "kernel_log": "kmsg"})
    w = start(opts)
    log_to_kmsg(xid())
    assert w.check_announced()  # the fast path: the Xid's device checked and taken out between rounds
    w.write()
    assert "0" not in gpu_names(tmp_path)
    node = Node(str(root), state_dir=opts.state_dir, kernel_log="kmsg")
    assert {h.pci_address: h.health for h in node.health()}["0000:18:00.0"] == "unhealthy"
    healthstate.request_put_back(str(root), opts.state_dir, KEY, kernel_log="kmsg")
    assert rounds(w, 3) == [False, False, True] and "0" in gpu_names(tmp_path)
    w = start(opts)  # a restart after the put-back: the old Xid is not read again as a new fault
    assert rounds(w, 3) == [False] * 3 and "0" in gpu_names(tmp_path)
    assert {h.pci_address: h.health for h in node.health()}["0000:18:00.0"] == "healthy"
    os.unlink(Path(opts.state_dir) / "health.json")  # no agent's verdict: a fresh check honours the put-back
    assert {h.pci_address: h.health for h in node.health()}["0000:18:00.0"] == "healthy"


# --- the journal -------------------------------------------------------------------------------------------
def write_journal(directory: Path, boot: str, *messages: str) -> None:
    """Kernel-transport entries appended to a journal file, as journald writes the kernel's lines."""
    require(os.access(JOURNAL_REMOTE, os.X_OK), f"{JOURNAL_REMOTE} (Debian's systemd-journal-remote) writes the "
            "test's journal file")
    export = "".join(f"__REALTIME_TIMESTAMP={time.time_ns() // 1000 + i}\n__MONOTONIC_TIMESTAMP={1000 + i}\n"
                     f"_BOOT_ID={boot}\n_TRANSPORT=kernel\nPRIORITY=3\nMESSAGE={text}\n\n"
                     for i, text in enumerate(messages))
    done = subprocess.run([JOURNAL_REMOTE, f"--output={directory / 'system.journal'}", "-"], input=export,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def journal_root(host_copy):
    require(shutil.which("journalctl") is not None, "journalctl (systemd) reads the journal")
    root = host_copy("hgx-h100")
    boot = uuid.uuid4().hex
    (root / "proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(str(uuid.UUID(boot)) + "\n")
    directory = root / "var/log/journal" / uuid.uuid4().hex  # a machine id
    directory.mkdir(parents=True)
    write_journal(directory, uuid.uuid4().hex, xid(slot="0000:2a:00"))  # an earlier boot's: not this boot's
    write_journal(directory, boot, "Linux version 6.1.0")
    return root, directory, boot


def test_journal_is_chosen_by_auto_read_once_and_followed_across_a_restart(journal_root):
    root, directory, boot = journal_root
    host = Host(str(root))
    follower = kernelmsg.open_source(host, "auto")
    assert isinstance(follower, kernelmsg.Journal), follower.description  # no kmsg under the root
    assert [m.text for m in follower.messages()] == [b"Linux version 6.1.0"]  # this boot's kernel lines only
    try:
        assert follower.read() == b""  # the first look notes the newest entry
        write_journal(directory, boot, xid())
        deadline = time.monotonic() + 10
        got = b""
        while xid().encode() not in got and time.monotonic() < deadline:
            time.sleep(0.05)
            if follower.pending():
                got += follower.read()
        assert xid().encode() in got
        saved = follower.position()
    finally:
        follower.close()
    write_journal(directory, boot, xid(code=48))  # while no agent ran
    again = kernelmsg.open_source(host, "journal")
    again.resume(*saved)
    try:
        deadline = time.monotonic() + 10
        got = b""
        while xid(code=48).encode() not in got and time.monotonic() < deadline:
            time.sleep(0.05)
            got += again.read()
        assert xid(code=48).encode() in got and xid().encode() not in got
    finally:
        again.close()


def test_health_reads_the_journal_and_honours_a_put_back(journal_root, tmp_path):
    root, directory, boot = journal_root
    write_journal(directory, boot, xid())
    state = tmp_path / "state"
    node = Node(str(root), state_dir=str(state))
    verdicts = {h.pci_address: h.health for h in node.health()}
    assert verdicts["0000:18:00.0"] == "unhealthy" and verdicts["0000:2a:00.0"] == "healthy"  # another boot's
    healthstate.request_put_back(str(root), str(state), KEY)
    assert {h.pci_address: h.health for h in Node(str(root), state_dir=str(state)).health()}[
        "0000:18:00.0"] == "healthy"
    put_backs = json.loads((state / healthstate.PUT_BACKS_FILE).read_text())
    assert put_backs[KEY]["kernel_log"]["identity"].startswith("journal:")
