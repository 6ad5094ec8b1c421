"""A command pointed at the wrong place says so in one line naming the path, exits non-zero and writes
nothing: a typo'd --root is not a node without devices (which `health` called healthy), a --profile-dir
that is not there is not skipped, a --state-dir that is a file is not ignored, and a file devinject may not
read is reported as that, not as missing."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import HOSTS
from tests.e2e.conftest import require
from tests.unit.test_cli import DEVINJECT, one_error_line, run

HGX = str(HOSTS / "hgx-h100")
GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
# Every command that reads a host, as a user runs it; `{out}` is a directory it would write into.
HOST_COMMANDS = {
    "health": ["health"],
    "list": ["list", "--state-dir", "/nonexistent"],
    "topo": ["topo"],
    "who": ["who", "--state-dir", "/nonexistent"],
    "generate": ["generate", "--hook-path", "/usr/bin/devinject", "--output-dir", "{out}"],
    "create-dev-char-links": ["create-dev-char-links", "--dry-run"],
}


def _args(command, out):
    return [a.replace("{out}", str(out)) for a in HOST_COMMANDS[command]]


def _wrong_root(tmp_path, how):
    if how == "missing":
        return tmp_path / "nonexistent"
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file"


@pytest.mark.parametrize("how", ["missing", "a file"])
@pytest.mark.parametrize("command", sorted(HOST_COMMANDS))
def test_a_wrong_root_is_one_line_naming_it(tmp_path, command, how):
    root = _wrong_root(tmp_path, how)
    done = run(*_args(command, tmp_path / "out"), "--root", str(root))
    line = one_error_line(done)
    assert line == f"devinject: error: --root {root}: {'no such directory' if how == 'missing' else 'not a directory'}"
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["health", "list", "topo", "generate"])
def test_a_profile_dir_that_is_not_there_is_an_error_not_skipped(tmp_path, command):
    done = run(*_args(command, tmp_path / "out"), "--root", HGX, "--profile-dir", str(tmp_path / "nowhere"))
    assert one_error_line(done) == f"devinject: error: --profile-dir {tmp_path / 'nowhere'}: no such directory"
    assert done.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["list", "who", "events", "watch", "device-plugin"])
def test_a_state_dir_that_is_a_file_is_an_error_not_ignored(tmp_path, command):
    state = tmp_path / "state"
    state.write_text("not a directory\n")
    args = {"list": ["list", "--root", HGX], "who": ["who", "--root", HGX], "events": ["events"],
            "watch": ["watch", "--root", HGX, "--output-dir", str(tmp_path / "out"), "--no-uevents"],
            "device-plugin": ["device-plugin", "--root", HGX, "--output-dir", str(tmp_path / "out"), "--no-uevents",
                              "--plugin-dir", str(tmp_path / "plugins"), "--metrics-address", ""]}[command]
    done = subprocess.run([DEVINJECT, *args, "--state-dir", str(state)], capture_output=True, text=True, timeout=30)
    assert one_error_line(done) == f"devinject: error: --state-dir {state}: not a directory"
    assert state.read_text() == "not a directory\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / "plugins").exists()
    below = state / "devinject"  # absent, and cannot be made: its parent is that file
    done = subprocess.run([DEVINJECT, *args, "--state-dir", str(below)], capture_output=True, text=True, timeout=30)
    assert one_error_line(done) == (f"devinject: error: --state-dir {below}: cannot be created: "
                                    f"{state} is not a directory")


def test_an_absent_state_dir_that_can_be_made_is_fine_and_not_made_by_a_reader(tmp_path):
    done = run("list", "--root", HGX, "--json", "--state-dir", str(tmp_path / "not-yet"))
    assert done.returncode == 0 and '"nvidia.com/gpu=0"' in done.stdout
    assert not (tmp_path / "not-yet").exists()


def test_a_kernel_log_asked_for_must_be_there_the_default_may_be_missing(tmp_path):
    assert run("health", "--root", HGX).returncode == 0  # the fixture has no /var/log/kern.log
    done = run("health", "--root", HGX, "--kernel-log", "/var/log/kern.log")
    assert one_error_line(done) == (f"devinject: error: --kernel-log /var/log/kern.log: no such file (under --root: "
                                    f"{HGX}/var/log/kern.log)")
    assert done.stdout == ""
    done = run("list", "--root", HGX, "--kernel-log", "/var/log", "--state-dir", "/nonexistent")
    assert one_error_line(done).endswith("--kernel-log /var/log: no such file" + f" (under --root: {HGX}/var/log)")


@pytest.fixture
def readable_copy():
    """hgx-h100 copied where uid nobody can reach it (pytest's tmp_path is root's alone)."""
    require(os.geteuid() == 0 and shutil.which("setpriv"), "needs root and setpriv to run devinject as nobody")
    base = Path(tempfile.mkdtemp(prefix="devinject-roots-"))
    os.chmod(base, 0o755)
    root = base / "hgx-h100"
    shutil.copytree(HGX, root, symlinks=True)
    yield root
    shutil.rmtree(base)


def _as_nobody(*args):
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", DEVINJECT, *args],
                          capture_output=True, text=True, timeout=60, cwd="/")


@pytest.mark.parametrize(("command", "attribute"), [("list", "vendor"), ("health", "vendor"),
                                                    ("generate", "vendor"), ("list", "aer_dev_fatal"),
                                                    ("health", "aer_dev_fatal")])
def test_a_sysfs_file_a_non_root_reader_may_not_read_is_permission_denied_naming_it(readable_copy, command,
                                                                                   attribute):
    """Was: `vendor` unreadable skipped GPU 0 with a warning (7 GPUs, exit 0); `aer_dev_fatal` read as 0
    fatal errors (healthy, exit 0)."""
    assert _as_nobody("list", "--root", str(readable_copy), "--state-dir", "/nonexistent").returncode == 0
    os.chmod(readable_copy / GPU / attribute, 0)
    args = {"list": ["list", "--state-dir", "/nonexistent"], "health": ["health"],
            "generate": ["generate", "--output", "-", "--hook-path", "/usr/bin/devinject"]}[command]
    done = _as_nobody(*args, "--root", str(readable_copy))
    assert one_error_line(done) == (f"devinject: error: {readable_copy / GPU / attribute}: permission denied "
                                    "(uid 65534 may not read it)")
    assert done.stdout == ""


def test_a_root_or_kernel_log_a_non_root_reader_may_not_read_is_permission_denied(readable_copy):
    (readable_copy / "var/log").mkdir(parents=True)
    (readable_copy / "var/log/kern.log").write_text("NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus\n")
    os.chmod(readable_copy / "var/log/kern.log", 0o600)  # as Debian's root:adm 0640 is to a user not in adm
    done = _as_nobody("health", "--root", str(readable_copy))
    assert one_error_line(done) == "devinject: error: --kernel-log /var/log/kern.log: permission denied (uid 65534) " \
                                   f"(under --root: {readable_copy}/var/log/kern.log)"
    os.chmod(readable_copy, 0o700)
    done = _as_nobody("topo", "--root", str(readable_copy))
    assert one_error_line(done) == f"devinject: error: --root {readable_copy}: permission denied (uid 65534)"


def test_the_roots_own_profile_dir_a_non_root_reader_may_not_read_is_one_line_not_a_traceback(readable_copy):
    admin = readable_copy / "etc/devinject/profiles.d"
    admin.mkdir(parents=True)
    os.chmod(admin, 0o700)
    done = _as_nobody("list", "--root", str(readable_copy), "--state-dir", "/nonexistent")
    assert one_error_line(done) == f"devinject: error: {admin}: cannot read the profile directory: Permission denied"


def test_a_journal_a_non_root_reader_may_not_read_is_one_line_not_healthy(readable_copy):
    """`--kernel-log auto` picks the journal under the root; its files root's 0640 (the journal's group may read
    them): journalctl would show such a reader nothing and exit 0, every GPU healthy."""
    require(shutil.which("journalctl") is not None, "journalctl (systemd) reads the journal")
    machine = readable_copy / "var/log/journal/0123456789abcdef0123456789abcdef"
    machine.mkdir(parents=True)
    (machine / "system.journal").write_bytes(b"LPKSHHRH")
    os.chmod(machine / "system.journal", 0o640)
    for directory in (machine, machine.parent, machine.parent.parent):
        os.chmod(directory, 0o755)
    done = _as_nobody("health", "--root", str(readable_copy), "--state-dir", "/nonexistent")
    assert one_error_line(done) == (f"devinject: error: --kernel-log auto: {machine.parent}: no journal file is "
                                    "readable (uid 65534; the journal's group, systemd-journal or adm, may read it)")
