import os

import pytest

from devinject.core.errors import UnsafePathError
from devinject.linux.safepath import Root


@pytest.fixture
def rootfs(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "etc").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    return root, outside


def _where(root: Root, dir_fd: int) -> str:
    return root.relative_dir(dir_fd)


@pytest.mark.parametrize(
    "link_target",
    ["/", "../../../../..", "/../../..", "../.."],
    ids=["absolute-root", "dotdot-relative", "absolute-dotdot", "shallow-dotdot"],
)
def test_symlinked_lib_dir_stays_inside_the_rootfs(rootfs, link_target):
    root_dir, outside = rootfs
    (root_dir / "usr" / "lib" / "x86_64-linux-gnu").symlink_to(link_target)
    with Root(str(root_dir)) as root:
        dir_fd, name = root.walk_parent("/usr/lib/x86_64-linux-gnu/libcuda.so.1", create=True)
        try:
            assert _where(root, dir_fd) == "/"  # the link resolved to the rootfs itself
            assert name == "libcuda.so.1"
        finally:
            os.close(dir_fd)


def test_absolute_symlink_to_a_host_path_is_rerooted(rootfs, tmp_path):
    root_dir, outside = rootfs
    (root_dir / "usr" / "lib" / "evil").symlink_to(str(outside))  # an absolute host path
    with Root(str(root_dir)) as root:
        dir_fd, name = root.walk_parent("/usr/lib/evil/x", create=True)
        os.close(dir_fd)
    assert list(outside.iterdir()) == []  # nothing created on the host
    assert (root_dir / str(outside).lstrip("/")).is_dir()  # created inside the rootfs instead


def test_dotdot_in_the_request_cannot_climb_out(rootfs):
    root_dir, _ = rootfs
    with Root(str(root_dir)) as root:
        dir_fd, name = root.walk_parent("/../../../etc/passwd")
        try:
            assert (_where(root, dir_fd), name) == ("/etc", "passwd")
        finally:
            os.close(dir_fd)


def test_symlink_loop_is_refused(rootfs):
    root_dir, _ = rootfs
    (root_dir / "a").symlink_to("b")
    (root_dir / "b").symlink_to("a")
    with Root(str(root_dir)) as root, pytest.raises(UnsafePathError, match="too many symlinks"):
        root.walk_parent("/a/x")


def test_final_component_link_is_followed_in_root_by_resolve(rootfs):
    root_dir, outside = rootfs
    (root_dir / "etc" / "ld.so.cache").symlink_to(str(outside / "cache"))
    with Root(str(root_dir)) as root:
        dir_fd, name = root.resolve("/etc/ld.so.cache", create_dirs=True)
        try:
            assert (_where(root, dir_fd), name) == (str(outside), "cache")
        finally:
            os.close(dir_fd)


def test_file_in_the_middle_is_not_a_directory(rootfs):
    root_dir, _ = rootfs
    (root_dir / "etc" / "file").write_text("x")
    with Root(str(root_dir)) as root, pytest.raises(UnsafePathError, match="not a directory"):
        root.walk_parent("/etc/file/child")


def test_missing_without_create(rootfs):
    root_dir, _ = rootfs
    with Root(str(root_dir)) as root, pytest.raises(UnsafePathError, match="does not exist"):
        root.walk_parent("/opt/x/y")


def test_symlinks_replace_image_files_atomically_and_refuse_directories(tmp_path):
    from devinject.core.errors import HookError
    from devinject.hook.executor import Executor
    from devinject.hook.plan import Plan, Symlink

    rootfs = tmp_path / "rootfs"
    lib = rootfs / "usr" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.1").write_text("an image's own file")
    Executor(str(rootfs)).apply(Plan(links=(Symlink("libcuda.so.550", "/usr/lib/libcuda.so.1"),
                                            Symlink("libml.so.550", "/usr/lib/new/libml.so.1"))))
    assert os.readlink(lib / "libcuda.so.1") == "libcuda.so.550"
    assert os.readlink(lib / "new" / "libml.so.1") == "libml.so.550"
    assert sorted(p.name for p in lib.iterdir()) == ["libcuda.so.1", "new"]  # no temp files left
    (lib / "dir.so.1").mkdir()
    with pytest.raises(HookError, match="a directory is in the way"):
        Executor(str(rootfs)).apply(Plan(links=(Symlink("y", "/usr/lib/made/y.so.1"),
                                                Symlink("x", "/usr/lib/dir.so.1"))))
    assert not (lib / "made").exists()  # rolled back: the link and the directory made for it are gone


def test_the_executor_leaves_no_descriptor_open_whether_it_succeeds_or_rolls_back(tmp_path):
    """The hook server's worker and a long-lived caller run it in their own process: every directory fd it
    took (walks, the directories it made) is closed again."""
    from devinject.core.errors import HookError
    from devinject.hook.executor import Executor
    from devinject.hook.plan import Plan, Symlink

    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "taken.so.1").mkdir()
    before = sorted(os.listdir("/proc/self/fd"))
    Executor(str(rootfs)).apply(Plan(links=(Symlink("x", "/usr/lib/new/deeper/libx.so.1"),
                                            Symlink("y", "/opt/lib/liby.so.1"))))
    assert (rootfs / "usr" / "lib" / "new" / "deeper" / "libx.so.1").is_symlink()
    with pytest.raises(HookError):
        Executor(str(rootfs)).apply(Plan(links=(Symlink("z", "/srv/made/libz.so.1"), Symlink("t", "/taken.so.1"))))
    assert not (rootfs / "srv").exists()
    assert sorted(os.listdir("/proc/self/fd")) == before
