"""Carries out a plan inside the container's mount namespace (before pivot_root, so host paths still
resolve), recording an undo step for everything it changes. Every container path goes through `safepath`."""

from __future__ import annotations

import errno
import os
import posixpath  # loaded by os already: no cost on the hook's start
import stat

from devinject.core import atomicfile
from devinject.core.errors import HookError, UnsafePathError
from devinject.core.mountinfo import parse_mountinfo
from devinject.hook import linkercache, syscalls
from devinject.hook.plan import BindMount, ForwardCompat, MakeNode, Plan, Symlink, newer_than
from devinject.hook.safepath import _O_PATH, Created, Root

TYPE_CHECKING = False  # `typing` and `collections` cost the hook milliseconds: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable


class Undo:
    """Undo steps, run newest first; each is best effort so one failure does not stop the rest."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []
        self.fds: list[int] = []

    def add(self, step: Callable[[], None]) -> None:
        self.steps.append(step)

    def keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def rollback(self) -> None:
        for step in reversed(self.steps):
            try:
                step()
            except (OSError, HookError):
                pass
        self.steps.clear()

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


# MS_RDONLY, MS_NOSUID, MS_NODEV and MS_NOEXEC have the same bits as MOUNT_ATTR_RDONLY ... _NOEXEC.
_MOUNT_ATTRS = syscalls.MS_RDONLY | syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC


def _proc_fd(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _read_proc(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _mount_id(fd: int) -> str | None:
    """The id of the mount holding `fd`: one statx call (Linux >= 5.8), else from /proc/self/fdinfo."""
    found = syscalls.mount_id(fd)
    if found is not None:
        return str(found)
    try:
        info = _read_proc(f"/proc/self/fdinfo/{fd}").decode("ascii", "replace")
        return next(line.split()[1] for line in info.splitlines() if line.startswith("mnt_id:"))
    except (OSError, StopIteration, IndexError):
        return None


class Executor:
    def __init__(self, rootfs: str, sonames: linkercache.SonameMemo | None = None) -> None:
        self.rootfs = rootfs
        self.sonames = sonames  # libraries read on earlier starts, for the linker cache
        self.root = Root(rootfs)
        self.undo = Undo()
        self.created = Created()
        self.log: list[str] = []
        self.mount_api = True  # open_tree/mount_setattr/move_mount; cleared when the kernel lacks them
        self._shared: dict[str, bool] = {}  # mount id -> shared, read once (again on a miss)

    # --- device nodes --------------------------------------------------------------------------------
    def make_node(self, node: MakeNode) -> None:
        dir_fd, name = self.root.walk_parent(node.path, create=True, created=self.created)
        self.undo.keep(dir_fd)
        kind = stat.S_IFCHR if node.type == "c" else stat.S_IFBLK
        rdev = os.makedev(node.major, node.minor)
        try:
            existing = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if existing is not None:
            if stat.S_IFMT(existing.st_mode) == kind and existing.st_rdev == rdev:
                self.log.append(f"node {node.path} present")
                return
            if stat.S_ISDIR(existing.st_mode):
                raise HookError(f"device node {node.path}: a directory is in the way in the container")
            os.unlink(name, dir_fd=dir_fd)  # an image file or link where the node belongs: never followed
        previous_umask = os.umask(0)  # the node gets exactly its mode: no chmod through a name later
        try:
            os.mknod(name, kind | node.mode, rdev, dir_fd=dir_fd)
        except PermissionError:
            self._bind_node(node, dir_fd, name)  # user namespace: mknod is not permitted
            return
        finally:
            os.umask(previous_umask)
        self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        self._chown_node(node, dir_fd, name, kind, rdev)
        self.log.append(f"mknod {node.path} {node.type} {node.major}:{node.minor}")

    @staticmethod
    def _chown_node(node: MakeNode, dir_fd: int, name: str, kind: int, rdev: int) -> None:
        """chown the node just made, through an fd checked to be that node (a name swapped for a link or
        another file in between is refused, never followed)."""
        fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if stat.S_IFMT(st.st_mode) != kind or st.st_rdev != rdev:
                raise HookError(f"device node {node.path}: replaced while it was being created")
            if (st.st_uid, st.st_gid) != (node.uid, node.gid):
                os.chown(_proc_fd(fd), node.uid, node.gid)
        finally:
            os.close(fd)

    def _bind_node(self, node: MakeNode, dir_fd: int, name: str) -> None:
        os.close(os.open(name, atomicfile.NEW_FILE, 0o644, dir_fd=dir_fd))
        self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        self._mount_on(node.host_path, dir_fd, name, syscalls.MS_NOSUID | syscalls.MS_NOEXEC, node.path)
        self.log.append(f"bind {node.host_path} -> {node.path} (mknod not permitted)")

    # --- mounts --------------------------------------------------------------------------------------
    def bind_mount(self, mount: BindMount) -> None:
        try:
            source = os.stat(mount.host_path)
        except OSError as err:
            raise HookError(f"mount source {mount.host_path}: {err.strerror}") from None
        dir_fd, name = self.root.resolve(mount.container_path, create_dirs=True, created=self.created)
        self.undo.keep(dir_fd)
        target: os.stat_result | None
        try:
            target = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            target = self._make_target(dir_fd, name, stat.S_ISDIR(source.st_mode))
        if target is not None:  # None: made here, empty, and the mount goes on it
            if (target.st_dev, target.st_ino) == (source.st_dev, source.st_ino):
                self.log.append(f"mount {mount.container_path} present")
                return  # the hook already ran for this container: never stack a second mount
            if stat.S_ISDIR(target.st_mode) != stat.S_ISDIR(source.st_mode):
                raise HookError(f"mount {mount.container_path}: file/directory mismatch with {mount.host_path}")
        flags = (syscalls.MS_RDONLY * mount.readonly | syscalls.MS_NOSUID * mount.nosuid
                 | syscalls.MS_NODEV * mount.nodev | syscalls.MS_NOEXEC * mount.noexec)
        self._mount_on(mount.host_path, dir_fd, name, flags, mount.container_path, recursive=mount.recursive)
        self.log.append(f"bind {mount.host_path} -> {mount.container_path}")

    def _make_target(self, dir_fd: int, name: str, directory: bool) -> os.stat_result | None:
        """An empty file or directory to mount on (None); what is there when another container's hook on a
        shared rootfs made it meanwhile (its stat: checked as any existing target, and not ours to undo)."""
        try:
            if directory:
                os.mkdir(name, 0o755, dir_fd=dir_fd)
                self.undo.add(lambda: os.rmdir(name, dir_fd=dir_fd))
            else:
                os.close(os.open(name, atomicfile.NEW_FILE, 0o644, dir_fd=dir_fd))
                self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        except FileExistsError:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return None

    def _mount_on(self, source: str, dir_fd: int, name: str, flags: int, shown: str, *,
                  recursive: bool = False) -> None:
        target = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if self._in_shared_mount(target):
                raise HookError(f"mount {shown}: the target is inside a shared mount, so the mount would "
                                "propagate to the host; give that volume private or slave propagation")
            if self.mount_api:
                try:
                    self._attach_sealed(source, target, flags, recursive)
                except OSError as err:
                    if err.errno != errno.ENOSYS:
                        raise HookError(f"mount {source} on {shown}: {os.strerror(err.errno or 0)}") from None
                    self.mount_api = False
                    self.log.append("kernel lacks open_tree/mount_setattr: bind, then remount read-only")
                else:
                    self.undo.add(lambda: self._unmount(dir_fd, name))
                    return
            try:
                syscalls.mount(source, _proc_fd(target), syscalls.MS_BIND | syscalls.MS_REC * recursive)
            except OSError as err:
                raise HookError(f"mount {source} on {shown}: {os.strerror(err.errno or 0)}") from None
        finally:
            os.close(target)
        self.undo.add(lambda: self._unmount(dir_fd, name))
        # Old kernels only: a bind mount ignores MS_RDONLY & co., so remount the new mount (reopened by name).
        fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            syscalls.mount(None, _proc_fd(fd), syscalls.MS_REMOUNT | syscalls.MS_BIND | flags)
        except OSError as err:
            raise HookError(f"remount {shown} read-only: {os.strerror(err.errno or 0)}") from None
        finally:
            os.close(fd)

    @staticmethod
    def _attach_sealed(source: str, target: int, flags: int, recursive: bool) -> None:
        """A detached clone of `source`, made read-only (nosuid, nodev...) and private while nobody can see
        it, then attached on the verified target fd: no window with a writable mount, no name looked up
        again."""
        tree = syscalls.open_tree_clone(source, recursive=recursive)
        try:
            syscalls.mount_setattr(tree, flags & _MOUNT_ATTRS, recursive=recursive)
            syscalls.move_mount(tree, target)
        finally:
            os.close(tree)

    def _in_shared_mount(self, fd: int) -> bool:
        """Whether the mount holding `fd` propagates to peers (`shared:N` in mountinfo): a mount attached
        there would appear on the host too. Mounts devinject attached itself are private. Asked of the kernel
        for that one mount (statmount) where it can answer; else looked up in /proc/self/mountinfo, which
        lists every mount in the namespace (~8 ms to read with 3,000 mounts, a busy node's count)."""
        propagation = syscalls.mount_propagation(fd)
        if propagation is not None:
            return bool(propagation & syscalls.MS_SHARED)
        mount_id = _mount_id(fd)
        if mount_id is None:
            return False  # no statx mount id and no fdinfo (not Linux or no /proc): nothing to go on
        if mount_id not in self._shared:  # a mount not seen yet (one attached since): read the table again
            mountinfo = _read_proc("/proc/self/mountinfo").decode("utf-8", "replace")
            self._shared.update((m.mount_id, m.shared) for m in parse_mountinfo(mountinfo, mount_id=mount_id))
        return self._shared.get(mount_id, False)

    @staticmethod
    def _unmount(dir_fd: int, name: str) -> None:
        fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            syscalls.umount(_proc_fd(fd))
        finally:
            os.close(fd)

    # --- links and the linker cache -----------------------------------------------------------------
    def symlink(self, link: Symlink) -> None:
        dir_fd, name = self.root.walk_parent(link.link, create=True, created=self.created)
        self.undo.keep(dir_fd)
        try:
            os.symlink(link.target, name, dir_fd=dir_fd)  # the usual case: nothing there yet
        except FileExistsError:
            try:
                if os.readlink(name, dir_fd=dir_fd) == link.target:
                    return  # made by an earlier run of the hook for this container
            except OSError:  # not a link
                in_way = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if self._is_target(in_way, link):
                    # the link's own target, mounted there already (a device plugin's Allocate answer
                    # mounts what this hook would link, for runtimes without CDI): the container has it
                    self.log.append(f"symlink {link.link}: its target is mounted there already")
                    return
                if stat.S_ISDIR(in_way.st_mode):
                    raise HookError(f"link {link.link}: a directory is in the way in the container") from None
            # an image file or link in the way: replace it atomically, never write through it
            tmp = f".{name}.devinject-{os.getpid()}"
            os.symlink(link.target, tmp, dir_fd=dir_fd)
            try:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError as err:
                os.unlink(tmp, dir_fd=dir_fd)
                if err.errno == errno.EBUSY:
                    raise HookError(f"link {link.link}: another file is mounted there in the container") from None
                raise
        self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        self.log.append(f"symlink {link.link} -> {link.target}")

    def _is_target(self, in_way: os.stat_result, link: Symlink) -> bool:
        """Whether `in_way` (what stands at the link's path) is the very file the link would name, resolved
        in the container's root."""
        target = link.target if link.target.startswith("/") else \
            posixpath.join(posixpath.dirname(link.link), link.target)
        try:
            dir_fd, name = self.root.resolve(posixpath.normpath(target))
        except (UnsafePathError, OSError):
            return False
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        finally:
            os.close(dir_fd)
        return (st.st_dev, st.st_ino) == (in_way.st_dev, in_way.st_ino)

    def _is_musl(self) -> str | None:
        for lib in ("/lib", "/usr/lib"):
            fd = self.root.open_dir(lib)
            if fd is None:
                continue
            try:
                loaders = [n for n in os.listdir(fd) if n.startswith("ld-musl-") and n.endswith(".so.1")]
            finally:
                os.close(fd)
            if loaders:
                return loaders[0][len("ld-musl-"):-len(".so.1")]
        return None

    def _forward_compat(self, compat: ForwardCompat) -> str | None:
        """`compat.directory` when the image carries a newer `library` there than the host driver (its
        libraries must then be found first), else None. Names only: nothing from the image is opened."""
        dir_fd = self.root.open_dir(compat.directory)
        if dir_fd is None:
            return None
        try:
            names = os.listdir(dir_fd)
        finally:
            os.close(dir_fd)
        prefix = compat.library + "."
        versions = [n[len(prefix):] for n in names if n.startswith(prefix)]
        newer = [v for v in versions if newer_than(v, compat.host_version)]
        if not newer:
            return None
        self.log.append(f"forward compat {compat.directory} ({compat.library} {max(newer)} > {compat.host_version})")
        return compat.directory

    def update_ldcache(self, folders: tuple[str, ...], compat: tuple[ForwardCompat, ...] = ()) -> None:
        first = tuple(d for d in (self._forward_compat(c) for c in compat) if d)
        folders = tuple(dict.fromkeys((*first, *folders)))  # the image's newer libraries win ties
        musl_arch = self._is_musl()
        if musl_arch:
            self._write_musl_path(musl_arch, folders)
            return
        etc_fd, name, previous = linkercache.update(self.root, folders, self.created, self.sonames)
        self.undo.keep(etc_fd)
        if previous is None:
            self.undo.add(lambda: os.unlink(name, dir_fd=etc_fd))
        else:
            self.undo.add(lambda: atomicfile.replace_at(etc_fd, name, previous))
        self.log.append(f"ld.so.cache {' '.join(folders)}")

    def _write_musl_path(self, arch: str, folders: tuple[str, ...]) -> None:
        dir_fd, name = self.root.walk_parent(f"/etc/ld-musl-{arch}.path", create=True, created=self.created)
        try:
            fd = linkercache.open_regular(dir_fd, name)
            if fd is None:
                existing = ["/lib", "/usr/local/lib", "/usr/lib"]  # musl's built-in default
            else:
                with os.fdopen(fd) as handle:
                    existing = [line.strip() for line in handle.read(65536).splitlines() if line.strip()]
            wanted = list(dict.fromkeys([*existing, *folders]))
            atomicfile.replace_at(dir_fd, name, ("\n".join(wanted) + "\n").encode())
        finally:
            os.close(dir_fd)
        self.log.append(f"musl path {' '.join(folders)}")

    # --- whole plan ----------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> list[str]:
        """Carry out `plan`; on failure undo everything and raise HookError."""
        try:
            for node in plan.nodes:
                self.make_node(node)
            for mount in plan.mounts:
                self.bind_mount(mount)
            for link in plan.links:
                self.symlink(link)
            if plan.ldcache_folders:
                self.update_ldcache(plan.ldcache_folders, plan.forward_compat)
        except (OSError, HookError) as err:
            self.rollback()
            if isinstance(err, HookError):
                raise
            raise HookError(f"{err.filename or 'container'}: {err.strerror}") from None
        finally:
            self.undo.close()
            self.root.close()
            self.created.close()
        return self.log

    def rollback(self) -> None:
        self.undo.rollback()
        for dir_fd, name in reversed(self.created.dirs):
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError:
                pass
