import os
import shutil
import tempfile
from pathlib import Path

from devinject.discovery.host import Host
from tests.e2e.conftest import require


def test_absolute_link_is_rerooted_not_followed_onto_this_machine(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("fixture\n")
    (tmp_path / "link").symlink_to("/etc/passwd")
    host = Host(str(tmp_path))
    assert host.resolve("/link") == "/etc/passwd"
    assert host.read_text("/link") == "fixture\n"


def test_dotdot_cannot_climb_out_of_root(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "up").symlink_to("../../../../../etc")
    host = Host(str(tmp_path))
    assert host.resolve("/a/up/hosts") == "/etc/hosts"
    assert host.real(host.resolve("/a/up/hosts")).startswith(str(tmp_path))


def test_link_loop_terminates(tmp_path):
    (tmp_path / "x").symlink_to("y")
    (tmp_path / "y").symlink_to("x")
    host = Host(str(tmp_path))
    assert host.resolve("/x") in ("/x", "/y")
    assert host.read_text("/x") is None


def test_chain_lists_every_hop(tmp_path):
    lib = tmp_path / "usr" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.550.54.14").write_bytes(b"")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.550.54.14")
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    assert Host(str(tmp_path)).resolve_chain("/usr/lib/libcuda.so") == [
        "/usr/lib/libcuda.so", "/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.550.54.14"]


def test_links_in_parent_directories_resolve(tmp_path):
    (tmp_path / "real" / "dir").mkdir(parents=True)
    (tmp_path / "real" / "dir" / "f").write_text("x")
    (tmp_path / "alias").symlink_to("real")
    host = Host(str(tmp_path))
    assert host.resolve("/alias/dir/f") == "/real/dir/f"
    assert host.glob("/alias/*/f") == ["/alias/dir/f"]


def test_missing_and_unreadable_files_read_as_none(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "attr").write_text("1\n")
    host = Host(str(tmp_path))
    assert host.read_attr("/missing") is None
    assert host.listdir("/missing") == []
    assert host.read_attr("/adir") is None  # open() fails (a directory): the same path as a dead device's EIO
    assert host.read_attr("/attr") == "1"


def _as_nobody(fn):
    """`fn()`'s repr as a process of uid/gid nobody computes it (root reads any mode, so the reader drops)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked reader
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                answer = repr(fn())
            except Exception as err:  # handed back to the test as text
                answer = f"{type(err).__name__}: {err}"
            os.write(write_end, answer.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as handle:
        answer = handle.read()
    os.waitpid(child, 0)
    return answer


def test_a_file_the_reader_may_not_read_is_permission_denied_naming_it_not_absent():
    """Every file discovery reads is world-readable on a real host: a denial is reported, never read as a
    missing attribute (which skipped the device, or read a failing GPU's AER counter as 0)."""
    require(os.geteuid() == 0, "needs root to run the reader as nobody")
    root = Path(tempfile.mkdtemp(prefix="devinject-host-"))
    try:
        os.chmod(root, 0o755)
        (root / "secret").write_text("x\n")
        os.chmod(root / "secret", 0)
        (root / "open").write_text("y\n")
        (root / "locked").mkdir()
        (root / "locked" / "attr").write_text("z\n")
        (root / "locked" / "link").symlink_to("attr")
        os.chmod(root / "locked", 0)
        host = Host(str(root))
        assert _as_nobody(lambda: (host.read_attr("/open"), host.read_attr("/missing"), host.listdir("/nope"),
                                   host.exists("/missing"))) == "('y', None, [], False)"
        denied = f"DiscoveryError: {root}/secret: permission denied (uid 65534 may not read it)"
        assert _as_nobody(lambda: host.read_attr("/secret")) == denied
        assert _as_nobody(lambda: host.read_bytes("/secret")) == denied
        for probe in (lambda: host.listdir("/locked"), lambda: host.read_attr("/locked/attr"),
                      lambda: host.exists("/locked/attr"), lambda: host.is_dir("/locked/attr"),
                      lambda: host.readlink("/locked/link"), lambda: host.lstat("/locked/attr")):
            assert _as_nobody(probe).startswith(f"DiscoveryError: {root}/locked"), _as_nobody(probe)
            assert "permission denied" in _as_nobody(probe)
    finally:
        os.chmod(root / "locked", 0o755)
        shutil.rmtree(root)
