import os

from devinject.host import Host


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
    secret = tmp_path / "secret"
    secret.write_text("x")
    os.chmod(secret, 0)
    host = Host(str(tmp_path))
    assert host.read_attr("/missing") is None
    assert host.listdir("/missing") == []
