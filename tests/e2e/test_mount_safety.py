"""The hook's mounts against an attacker sharing a directory with the container, and shared volumes.

Each scenario runs the executor in a private mount namespace of its own (`unshare -m`), as root.
"""

from __future__ import annotations

import os
import posix
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import in_private_mount_ns, require

pytestmark = pytest.mark.live

# A helper in a mount namespace of its own (made before the hook mounts anything, as another container's
# would be) renames the fresh mount point away and leaves a decoy file under its name, at the moment
# chosen by the test: right after the mount is attached.
RACE = r"""
import ctypes, os, sys
from devinject.linux import syscalls
from devinject.hook.executor import Executor
from devinject.hook.plan import BindMount, Plan

rootfs, host_file, path = sys.argv[1], sys.argv[2], sys.argv[3]
lib = os.path.join(rootfs, "lib")
go_r, go_w = os.pipe()
done_r, done_w = os.pipe()
if os.fork() == 0:
    os.close(go_w)
    os.close(done_r)
    if ctypes.CDLL(None, use_errno=True).unshare(syscalls.CLONE_NEWNS) == 0:
        os.write(done_w, b"ready")
        if os.read(go_r, 1):
            os.rename(os.path.join(lib, "driver.so"), os.path.join(lib, "moved.so"))
            open(os.path.join(lib, "driver.so"), "w").close()
            os.write(done_w, b"x")
    os._exit(0)
os.close(go_r)
os.close(done_w)
assert os.read(done_r, 5) == b"ready", "the attacker's namespace was not made"

def swap():
    os.write(go_w, b"x")
    assert os.read(done_r, 1) == b"x", "the attacker could not swap the name"

real_move, real_mount = syscalls.move_mount, syscalls.mount
def move_mount(tree, target):
    real_move(tree, target)
    swap()
def mount(source, target, flags):
    real_mount(source, target, flags)
    if not flags & syscalls.MS_REMOUNT:
        swap()
syscalls.move_mount, syscalls.mount = move_mount, mount

executor = Executor(rootfs)
executor.mount_api = path == "new"
try:
    executor.apply(Plan(mounts=(BindMount(host_file, "/lib/driver.so"),)))
except Exception as err:
    print("hook error:", err)
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    if fields[4].startswith(rootfs):
        print("MOUNT", fields[4], fields[5])
"""


def _rootfs_with_driver(tmp_path: Path) -> tuple[Path, Path]:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare")
    rootfs = tmp_path / "rootfs"
    (rootfs / "lib").mkdir(parents=True)
    host_file = tmp_path / "host-driver.so"
    host_file.write_text("driver")
    return rootfs, host_file


def _mounts(out: str) -> list[tuple[str, str]]:
    return [(line.split()[1], line.split()[2]) for line in out.splitlines() if line.startswith("MOUNT ")]


def test_a_name_swapped_after_the_bind_never_leaves_a_writable_driver_mount(tmp_path: Path) -> None:
    rootfs, host_file = _rootfs_with_driver(tmp_path)
    done = in_private_mount_ns(RACE, str(rootfs), str(host_file), "new")
    assert done.returncode == 0, done.stderr
    mounts = _mounts(done.stdout)
    assert mounts == [(f"{rootfs}/lib/moved.so", "ro,nosuid,nodev,relatime")], done.stdout
    assert host_file.read_text() == "driver"


def test_the_old_bind_then_remount_sequence_is_what_the_race_defeats(tmp_path: Path) -> None:
    """The scenario above really is the attack: on the fallback path (kernels without mount_setattr) the
    swap leaves a writable bind of the host file behind. Kept as a check that the race test can fail."""
    rootfs, host_file = _rootfs_with_driver(tmp_path)
    done = in_private_mount_ns(RACE, str(rootfs), str(host_file), "legacy")
    assert done.returncode == 0, done.stderr
    assert any(options.startswith("rw") for _, options in _mounts(done.stdout)), done.stdout


SHARED = r"""
import os, sys
from devinject.linux import syscalls
from devinject.hook.executor import Executor
from devinject.hook.plan import BindMount, Plan

rootfs, host_file, volume, lookup = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
if lookup in ("statx", "fdinfo"):  # a kernel without statmount (Linux < 6.8): the mountinfo table
    syscalls.mount_propagation = lambda fd: None
if lookup == "fdinfo":  # a kernel or C library without statx's mount id
    syscalls.mount_id = lambda fd, unique=False: None
inside = os.path.join(rootfs, "vol")
syscalls.mount(volume, volume, syscalls.MS_BIND)
syscalls.mount(None, volume, 1 << 20)  # MS_SHARED: the host side of an rshared volume
syscalls.mount(volume, inside, syscalls.MS_BIND)  # the container's view: a peer of the host's
try:
    Executor(rootfs).apply(Plan(mounts=(BindMount(host_file, "/usr/lib/driver.so"),)))
    print("mounted")
except Exception as err:
    print("hook error:", err)
print("host side:", sorted(os.listdir(volume)),
      any(line.split()[4].startswith(volume + "/") for line in open("/proc/self/mountinfo")))
"""


@pytest.mark.parametrize("lookup", ["statmount", "statx", "fdinfo"])
def test_a_mount_inside_a_shared_volume_is_refused_not_propagated(tmp_path: Path, lookup: str) -> None:
    """The image links its library dir into an rshared volume: a mount there would appear on the host. The
    target mount's propagation comes from statmount, else from mountinfo (the mount found by statx, or by
    /proc/self/fdinfo where statx cannot tell)."""
    rootfs, host_file = _rootfs_with_driver(tmp_path)
    volume = tmp_path / "volume"
    volume.mkdir()
    (rootfs / "vol").mkdir()
    (rootfs / "usr").mkdir()
    (rootfs / "usr" / "lib").symlink_to("/vol")
    done = in_private_mount_ns(SHARED, str(rootfs), str(host_file), str(volume), lookup)
    assert done.returncode == 0, done.stderr
    assert "hook error: mount /usr/lib/driver.so: the target is inside a shared mount" in done.stdout
    assert "host side: [] False" in done.stdout  # no mount and no leftover mount point on the host side


def test_device_nodes_get_their_exact_mode_and_a_swapped_name_is_never_followed(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    require(os.geteuid() == 0, "needs root (mknod, chown)")
    from devinject.core.errors import HookError
    from devinject.hook.executor import Executor
    from devinject.hook.plan import MakeNode, Plan

    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    old_umask = os.umask(0o077)
    try:
        Executor(str(rootfs)).apply(Plan(nodes=(MakeNode("/dev/fake0", "c", 1, 3, 0o666, 1000, 44, "/dev/null"),)))
    finally:
        os.umask(old_umask)
    st = (rootfs / "dev/fake0").lstat()
    assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == ("0o666", 1000, 44)

    host_file = tmp_path / "host-secret"
    host_file.write_text("secret")
    os.chmod(host_file, 0o600)
    real_mknod = os.mknod

    def mknod_then_swap(name, mode, device, *, dir_fd):  # type: ignore[no-untyped-def]
        real_mknod(name, mode, device, dir_fd=dir_fd)
        os.unlink(name, dir_fd=dir_fd)  # an attacker sharing /dev swaps the new node for a link
        os.symlink(str(host_file), name, dir_fd=dir_fd)

    monkeypatch.setattr(posix, "mknod", mknod_then_swap)  # what the executor calls (posix, not os)
    with pytest.raises(HookError, match="replaced while it was being created"):
        Executor(str(rootfs)).apply(Plan(nodes=(MakeNode("/dev/fake1", "c", 1, 3, 0o666, 1000, 44, "/dev/null"),)))
    st = host_file.stat()
    assert (oct(st.st_mode & 0o7777), st.st_uid) == ("0o600", 0)  # the host file kept its mode and owner


def test_statx_and_fdinfo_name_the_same_mount() -> None:
    from devinject.hook import executor
    from devinject.linux import syscalls

    for path in ("/", "/proc", "/dev", "/sys/fs/cgroup"):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
            expected = next(line.split()[1] for line in info.splitlines() if line.startswith("mnt_id:"))
            assert str(syscalls.mount_id(fd)) == expected == executor._mount_id(fd), path
        finally:
            os.close(fd)


SHARED_FLAGS = r"""
import os, sys
from devinject.linux.mountinfo import parse_mountinfo
from devinject.linux import syscalls

volume = sys.argv[1]
syscalls.mount(volume, volume, syscalls.MS_BIND)
syscalls.mount(None, volume, 1 << 20)  # MS_SHARED
table = {m.mount_point: m.shared for m in parse_mountinfo(open("/proc/self/mountinfo").read())}
for path in ("/", "/proc", volume):
    fd = os.open(path, os.O_PATH)
    flags = syscalls.mount_propagation(fd)
    print(path, flags is not None and bool(flags & syscalls.MS_SHARED), table[path])
"""


def test_statmount_and_mountinfo_agree_on_which_mounts_are_shared(tmp_path: Path) -> None:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare")
    done = in_private_mount_ns(SHARED_FLAGS, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["/ False False", "/proc False False", f"{tmp_path} True True"]

