"""Files root writes are root's alone (linux/trusteddir): state and log directories get an explicit mode and are
refused when others could change them, appends never follow a link, and caches keyed on a file's identity see
an edit in place that kept the file's size and mtime (its ctime cannot be kept)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.core.errors import DevinjectError, LedgerError
from devinject.hook.registry import Registry
from devinject.linux.trusteddir import append, trusted_dir
from devinject.nodestate import events
from devinject.nodestate.ledger import Claim, Ledger
from devinject.nodestate.profilefacts import sharing_policy
from tests.conftest import HOSTS
from tests.e2e.conftest import require, terminate

DEVINJECT = str(Path(sys.executable).parent / "devinject")
HGX = HOSTS / "hgx-h100"  # DEVINJECT_FIXTURES: make mutation runs the tests where the fixture trees are not


@pytest.fixture
def umask_0() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def keep_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    """Edit `path` in place (same inode, same size) and put its mtime back, as `touch -r` does."""
    before = path.stat()
    assert len(old) == len(new)
    with open(path, "r+b") as handle:
        text = handle.read()
        assert old in text
        handle.seek(0)
        handle.write(text.replace(old, new))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


# --- directories ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0, 0o077])
def test_directories_are_made_in_their_own_mode_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        trusted_dir(str(tmp_path / "a" / "b" / "state"))
        trusted_dir(str(tmp_path / "private"), 0o700)
    finally:
        os.umask(old)
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/state", "private")] == [0o755, 0o755, 0o755, 0o700]


@pytest.mark.parametrize(("setup", "reason"), [
    (lambda p: p.chmod(0o777), "is writable by group or others (mode 0777)"),
    (lambda p: p.chmod(0o1777), "is writable by group or others (mode 1777)"),
    (lambda p: p.chmod(0o775), "is writable by group or others (mode 0775)"),
    (lambda p: os.chown(p, 1000, 1000), "is owned by uid 1000"),
])
def test_a_directory_others_could_change_is_refused_in_one_line(tmp_path: Path, setup, reason: str) -> None:
    require(os.geteuid() == 0, "needs root (chown)")
    state = tmp_path / "state"
    state.mkdir()
    setup(state)
    with pytest.raises(DevinjectError) as caught:
        trusted_dir(str(state))
    assert caught.value.message == (f"{state}: the state directory {reason}; refused "
                                    "(devinject keeps root's files there)")


def test_a_link_or_a_file_is_no_directory(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("")
    with pytest.raises(DevinjectError, match=r"/link: the state directory is a symbolic link; refused"):
        trusted_dir(str(tmp_path / "link"))
    with pytest.raises(DevinjectError, match=r"/file: the state directory is not a directory; refused"):
        trusted_dir(str(tmp_path / "file"))


def test_the_ledger_refuses_a_state_dir_others_can_write(tmp_path: Path) -> None:
    """Anyone who can write the state dir can swap ledger.json (or its lock) between two hooks."""
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(LedgerError) as caught:
        Ledger(str(state)).book("a", os.getpid(), (Claim("vendor.com/gpu=0", ("c 195:0",)),),
                                {"vendor.com/gpu": "exclusive"})
    assert caught.value.message.startswith(f"{state}: the state directory is writable by group or others")
    assert list(state.iterdir()) == []


def test_sharing_facts_are_read_only_from_a_directory_that_is_roots_alone(tmp_path: Path) -> None:
    """A planted profile-facts cache would make an exclusive GPU shared."""
    state = tmp_path / "state"
    state.mkdir()
    sharing_policy(str(state))  # the real facts, cached
    cache = state / "profile-facts.json"
    data = json.loads(cache.read_text())
    data["policy"]["nvidia.com/gpu"] = "shared"
    cache.write_text(json.dumps(data))
    state.chmod(0o777)
    with pytest.raises(DevinjectError, match="the state directory is writable by group or others"):
        sharing_policy(str(state))


# --- appends -------------------------------------------------------------------------------------------


def test_events_under_umask_0_are_written_in_their_own_modes(tmp_path: Path, umask_0: None) -> None:
    state = tmp_path / "state"
    events.record(str(state), "taken-out", "vendor.com/gpu=0000:18:00.0", reasons=["AER"])
    assert {p.name: mode(p) for p in state.iterdir()} == {"events.jsonl": 0o644, "device-events.json": 0o644}
    assert mode(state) == 0o755


def test_an_event_log_replaced_by_a_link_is_not_followed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (state / "events.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link; not followed"):
        events.record(str(state), "watch-started")
    assert victim.read_text() == "precious\n"
    Ledger(str(state)).event("booked")  # the ledger's own record of it fails no container
    assert victim.read_text() == "precious\n"


def test_an_append_refuses_a_fifo_without_hanging_and_a_hard_link(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="No such device or address"):  # no reader: a blocking open would hang
        append(str(fifo), b"x\n")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:  # with a reader the open itself succeeds: the file type refuses it
        with pytest.raises(OSError, match="is not a regular file"):
            append(str(fifo), b"x\n")
    finally:
        os.close(reader)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.link(victim, tmp_path / "hard")
    with pytest.raises(OSError, match="has other hard links"):
        append(str(tmp_path / "hard"), b"x\n")
    assert victim.read_text() == "precious\n"


def test_an_existing_log_others_could_write_gets_its_mode_back(tmp_path: Path) -> None:
    log = tmp_path / "hook.log"
    log.write_text("")
    log.chmod(0o666)  # left by an older devinject under umask 0
    append(str(log), b"line\n")
    assert mode(log) == 0o644 and log.read_text() == "line\n"


def hook(state: Path, log: Path, bundle: Path) -> subprocess.CompletedProcess[str]:
    """A hook run that fails (no config.json in the bundle): an error is always logged."""
    oci = {"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": os.getpid(), "bundle": str(bundle)}
    return subprocess.run([DEVINJECT, "hook", "--no-server", "--state-dir", str(state), "--log-file", str(log)],
                          input=json.dumps(oci), capture_output=True, text=True, timeout=60)


def test_the_hook_skips_a_log_it_cannot_trust_and_says_so(tmp_path: Path) -> None:
    """The hook's choice: a log line is never a reason to fail (or start) a container, so a log it may not
    write is skipped with a warning on stderr; the link is never followed."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "hook.log").symlink_to(victim)
    done = hook(tmp_path / "state", tmp_path / "hook.log", tmp_path)
    assert done.stderr.splitlines()[-1] == (f"devinject: warning: {tmp_path}/hook.log: is a symbolic link; "
                                            "not followed; not logged")
    assert victim.read_text() == "precious\n"
    shared = tmp_path / "logs"
    shared.mkdir()
    shared.chmod(0o777)
    done = hook(tmp_path / "state", shared / "hook.log", tmp_path)
    assert done.stderr.splitlines()[-1].startswith(f"devinject: warning: {shared}: the log directory is writable by "
                                                   "group or others (mode 0777); refused")
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("command", [["watch"], ["device-plugin", "--metrics-address", ""]])
def test_the_node_agents_refuse_a_state_dir_others_can_write(tmp_path: Path, command: list[str]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    try:
        done = subprocess.run([DEVINJECT, *command, "--root", str(HGX), "--output-dir", str(tmp_path / "cdi"),
                               "--state-dir", str(state), "--no-uevents", "--test-timings", "--interval", "0.2",
                               *(["--plugin-dir", str(tmp_path / "plugins")] if command[0] == "device-plugin" else [])],
                              capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command[0]} ran with a state dir anyone can write")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"devinject: error: {state}: the state directory is writable by group or others")


def under_umask_0(*args: str) -> list[str]:
    return ["sh", "-c", 'umask 0; exec "$0" "$@"', DEVINJECT, *args]


def test_generate_under_umask_0_makes_a_spec_dir_the_hook_trusts(tmp_path: Path) -> None:
    """Under umask 0 the output dir came out 0777, and the hook refused every spec in it."""
    out = tmp_path / "new" / "cdi"
    done = subprocess.run(under_umask_0("generate", "--root", str(HGX), "--output-dir", str(out), "--hook-path",
                                        DEVINJECT), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (mode(tmp_path / "new"), mode(out)) == (0o755, 0o755)
    assert Registry((str(out),)).resolve(("nvidia.com/gpu=0",)).names == ("nvidia.com/gpu=0",)


def test_the_hook_server_under_umask_0_makes_its_socket_directories_0755(tmp_path: Path) -> None:
    top = Path(f"/tmp/di-rf-{os.getpid()}")  # a short socket path
    socket = top / "run" / "hook.sock"
    server = subprocess.Popen(under_umask_0("hook-server", "--socket", str(socket)), stderr=subprocess.PIPE,
                              text=True)
    try:
        for _ in range(400):
            if socket.exists() or server.poll() is not None:
                break
            time.sleep(0.025)
        assert socket.exists(), server.stderr.read() if server.stderr else ""
        assert (mode(top), mode(top / "run"), mode(socket)) == (0o755, 0o755, 0o600)
    finally:
        terminate(server, timeout=10)  # a loaded machine: never leave a server (and its workers) behind
        shutil.rmtree(top, ignore_errors=True)


# --- caches keyed on a file's identity -----------------------------------------------------------------

SPEC = ("cdiVersion: 0.5.0\nkind: rw.example/dir\ndevices:\n- name: a\n  containerEdits:\n"
        "    mounts: [{hostPath: /srv/data, containerPath: /data, options: [rw, bind]}]\n")


def test_a_spec_edited_in_place_with_its_size_and_mtime_kept_is_parsed_anew(tmp_path: Path) -> None:
    specs = tmp_path / "cdi"
    specs.mkdir()
    (specs / "dir.yaml").write_text(SPEC)
    cache = str(tmp_path / "state" / "spec-cache.json")
    first = Registry((str(specs),), cache_file=cache).resolve(("rw.example/dir=a",))
    assert first.edits.mounts[0].options == ("rw", "bind")
    keep_size_and_mtime(specs / "dir.yaml", b"[rw, bind]", b"[ro, bind]")
    again = Registry((str(specs),), cache_file=cache).resolve(("rw.example/dir=a",))
    assert again.edits.mounts[0].options == ("ro", "bind")


def test_a_spec_cache_in_a_directory_others_can_write_is_not_read(tmp_path: Path) -> None:
    """Whoever can write the cache can hand the hook any parse it likes: the cache is then not used."""
    specs = tmp_path / "cdi"
    specs.mkdir()
    (specs / "dir.yaml").write_text(SPEC)
    state = tmp_path / "state"
    cache = state / "spec-cache.json"
    Registry((str(specs),), cache_file=str(cache)).resolve(("rw.example/dir=a",))
    poisoned = {key: json.loads(json.dumps(raw).replace("/srv/data", "/etc"))
                for key, raw in json.loads(cache.read_text()).items()}
    st = (specs / "dir.yaml").stat()
    old_key = f"{specs}/dir.yaml:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"  # as an older devinject keyed it
    cache.write_text(json.dumps({**poisoned, old_key: next(iter(poisoned.values()))}))
    state.chmod(0o777)
    resolved = Registry((str(specs),), cache_file=str(cache)).resolve(("rw.example/dir=a",))
    assert resolved.edits.mounts[0].host_path == "/srv/data"


def test_a_profile_edited_in_place_with_its_size_and_mtime_kept_changes_the_sharing_policy(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "acme.yaml").write_text("name: acme\nkind: acme.example/npu\nmatch: {vendor: ['1da4']}\n"
                                        "sharing: shared   \n")
    state = str(tmp_path / "state")
    assert sharing_policy(state, profile_dirs=(str(profiles),))["acme.example/npu"] == "shared"
    keep_size_and_mtime(profiles / "acme.yaml", b"shared   ", b"exclusive")
    assert sharing_policy(state, profile_dirs=(str(profiles),))["acme.example/npu"] == "exclusive"
