"""Carries out a plan inside the container's mount namespace (before pivot_root, so host paths still
resolve), recording an undo step for everything it changes. Every container path goes through `safepath`.

`Steps.apply` is the one walk through a plan's steps, and `describe` the one wording of each: the `Executor`
performs them, `RecordingExecutor` (`hook --dry-run`) performs nothing and lists the same entries. A step the
executor finds already done, or does another way, says so after its description: `<step>; <how>`."""

from __future__ import annotations

import errno
import posix  # not `os`, ~0.9 ms of imports: the hook runs this on every container start
import stat

from devinject.core import atomicfile
from devinject.core.errors import HookError, UnsafePathError
from devinject.hook import linkercache, purepath
from devinject.hook.plan import (
    APPLICATION_PROFILE,
    BindMount,
    ForwardCompat,
    MakeNode,
    Plan,
    Symlink,
    application_profile,
    newer_than,
)
from devinject.linux.safepath import _O_PATH, Created, Root

TYPE_CHECKING = False  # `typing` and `collections` cost the hook milliseconds: type checkers only
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


class _Syscalls:
    """linux/syscalls.py (the C library: mount, open_tree...), imported when a node or a mount first needs it:
    a cdi-hook makes only links and the linker cache, and its start does not pay for the C library."""

    def __getattr__(self, name: str) -> object:
        from devinject.linux import syscalls as module

        globals()["syscalls"] = module
        return getattr(module, name)


if TYPE_CHECKING:
    from devinject.linux import syscalls
else:
    syscalls = _Syscalls()


class LinkerCache(NamedTuple):
    """A plan's last step: its library folders into the image's linker cache, an image directory of newer
    forward-compatible libraries first."""

    folders: tuple[str, ...]
    forward_compat: tuple[ForwardCompat, ...] = ()


_PROFILE_DIRS = tuple(APPLICATION_PROFILE.split("/")[2:-1])  # nvidia, nvidia-application-profiles-rc.d


class ApplicationProfile(NamedTuple):
    """The driver's application profile in the container, for the GPUs of these minors."""

    gpu_minors: tuple[int, ...]


if TYPE_CHECKING:
    Step = MakeNode | BindMount | Symlink | LinkerCache | ApplicationProfile


def describe(step: Step) -> str:
    """The one wording of a step, for the executor's log and `hook --dry-run` alike."""
    if isinstance(step, MakeNode):
        return f"mknod {step.path} {step.type} {step.major}:{step.minor} mode {step.mode:o} owner {step.uid}:{step.gid}"
    if isinstance(step, BindMount):
        return f"bind {step.host_path} -> {step.container_path}{' (ro)' if step.readonly else ''}"
    if isinstance(step, Symlink):
        return f"symlink {step.link} -> {step.target}"
    if isinstance(step, ApplicationProfile):
        mask = sum(1 << minor for minor in step.gpu_minors)
        return f"application profile {APPLICATION_PROFILE}: EGLVisibleDGPUDevices 0x{mask:x}"
    return f"ld.so.cache += {' '.join(step.folders)}"


def plan_steps(plan: Plan) -> list[Step]:
    """Every step of `plan` the container's filesystem sees, in the order they are taken."""
    steps: list[Step] = [*plan.nodes, *plan.mounts, *plan.links]
    if plan.gpu_minors:
        steps.append(ApplicationProfile(plan.gpu_minors))
    if plan.ldcache_folders:
        steps.append(LinkerCache(plan.ldcache_folders, plan.forward_compat))
    return steps


class Steps:
    """What carries out a plan: one method per kind of step, each returning how it went when that is not
    plainly what `describe` says (None). `apply` walks the plan and logs each step as it is taken. Here each
    step performs nothing (the recording executor); `Executor` performs them all."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def make_node(self, node: MakeNode) -> str | None:
        return None

    def bind_mount(self, mount: BindMount) -> str | None:
        return None

    def symlink(self, link: Symlink) -> str | None:
        return None

    def update_ldcache(self, folders: tuple[str, ...], compat: tuple[ForwardCompat, ...] = ()) -> str | None:
        return None

    def write_application_profile(self, gpu_minors: tuple[int, ...]) -> str | None:
        return None

    def take(self, step: Step) -> None:
        if isinstance(step, MakeNode):
            how = self.make_node(step)
        elif isinstance(step, BindMount):
            how = self.bind_mount(step)
        elif isinstance(step, Symlink):
            how = self.symlink(step)
        elif isinstance(step, ApplicationProfile):
            how = self.write_application_profile(step.gpu_minors)
        else:
            how = self.update_ldcache(step.folders, step.forward_compat)
        self.log.append(describe(step) if how is None else f"{describe(step)}; {how}")

    def apply(self, plan: Plan) -> list[str]:
        """Carry out `plan`; on failure undo everything and raise HookError. The log: one entry per step."""
        try:
            for step in plan_steps(plan):
                self.take(step)
        except (OSError, HookError) as err:
            self.rollback()
            if isinstance(err, HookError):
                raise
            raise HookError(f"{err.filename or 'container'}: {err.strerror}") from None
        finally:
            self.close()
        return self.log

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass


class RecordingExecutor(Steps):
    """`hook --dry-run`: the executor's walk through the plan, performing nothing; its log lists the steps."""


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
                posix.close(fd)
            except OSError:
                pass
        self.fds.clear()


# MS_RDONLY, MS_NOSUID, MS_NODEV and MS_NOEXEC have the same bits as MOUNT_ATTR_RDONLY ... _NOEXEC.
_MOUNT_ATTRS = 0x1 | 0x2 | 0x4 | 0x8


def _proc_fd(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _read_proc(path: str) -> bytes:
    fd = posix.open(path, posix.O_RDONLY | posix.O_CLOEXEC)
    try:
        chunks = []
        while chunk := posix.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        posix.close(fd)


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


class Executor(Steps):
    def __init__(self, rootfs: str, sonames: linkercache.SonameMemo | None = None) -> None:
        super().__init__()
        self.rootfs = rootfs
        self.sonames = sonames  # libraries read on earlier starts, for the linker cache
        self.root = Root(rootfs)
        self.undo = Undo()
        self.created = Created()
        self.mount_api = True  # open_tree/mount_setattr/move_mount; cleared when the kernel lacks them
        self._shared: dict[str, bool] = {}  # mount id -> shared, read once (again on a miss)

    # --- device nodes --------------------------------------------------------------------------------
    def make_node(self, node: MakeNode) -> str | None:
        dir_fd, name = self.root.walk_parent(node.path, create=True, created=self.created)
        self.undo.keep(dir_fd)
        kind = stat.S_IFCHR if node.type == "c" else stat.S_IFBLK
        rdev = posix.makedev(node.major, node.minor)
        try:
            existing = posix.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if existing is not None:
            if stat.S_IFMT(existing.st_mode) == kind and existing.st_rdev == rdev:
                return "present"
            if stat.S_ISDIR(existing.st_mode):
                raise HookError(f"device node {node.path}: a directory is in the way in the container")
            posix.unlink(name, dir_fd=dir_fd)  # an image file or link where the node belongs: never followed
        previous_umask = posix.umask(0)  # the node gets exactly its mode: no chmod through a name later
        try:
            posix.mknod(name, kind | node.mode, rdev, dir_fd=dir_fd)
        except PermissionError:
            return self._bind_node(node, dir_fd, name)  # user namespace: mknod is not permitted
        finally:
            posix.umask(previous_umask)
        self.undo.add(lambda: posix.unlink(name, dir_fd=dir_fd))
        self._chown_node(node, dir_fd, name, kind, rdev)
        return None

    @staticmethod
    def _chown_node(node: MakeNode, dir_fd: int, name: str, kind: int, rdev: int) -> None:
        """chown the node just made, through an fd checked to be that node (a name swapped for a link or
        another file in between is refused, never followed)."""
        fd = posix.open(name, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = posix.fstat(fd)
            if stat.S_IFMT(st.st_mode) != kind or st.st_rdev != rdev:
                raise HookError(f"device node {node.path}: replaced while it was being created")
            if (st.st_uid, st.st_gid) != (node.uid, node.gid):
                posix.chown(_proc_fd(fd), node.uid, node.gid)
        finally:
            posix.close(fd)

    def _bind_node(self, node: MakeNode, dir_fd: int, name: str) -> str:
        posix.close(posix.open(name, atomicfile.NEW_FILE, 0o644, dir_fd=dir_fd))
        self.undo.add(lambda: posix.unlink(name, dir_fd=dir_fd))
        how = self._mount_on(node.host_path, dir_fd, name, syscalls.MS_NOSUID | syscalls.MS_NOEXEC, node.path)
        return f"mknod not permitted: bound {node.host_path} there" + (f", {how}" if how else "")

    # --- mounts --------------------------------------------------------------------------------------
    def bind_mount(self, mount: BindMount) -> str | None:
        try:
            source = posix.stat(mount.host_path)
        except OSError as err:
            raise HookError(f"mount source {mount.host_path}: {err.strerror}") from None
        dir_fd, name = self.root.resolve(mount.container_path, create_dirs=True, created=self.created)
        self.undo.keep(dir_fd)
        target: posix.stat_result | None
        try:
            target = posix.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            target = self._make_target(dir_fd, name, stat.S_ISDIR(source.st_mode))
        if target is not None:  # None: made here, empty, and the mount goes on it
            if (target.st_dev, target.st_ino) == (source.st_dev, source.st_ino):
                return "present"  # the hook already ran for this container: never stack a second mount
            if stat.S_ISDIR(target.st_mode) != stat.S_ISDIR(source.st_mode):
                raise HookError(f"mount {mount.container_path}: file/directory mismatch with {mount.host_path}")
        flags = (syscalls.MS_RDONLY * mount.readonly | syscalls.MS_NOSUID * mount.nosuid
                 | syscalls.MS_NODEV * mount.nodev | syscalls.MS_NOEXEC * mount.noexec)
        return self._mount_on(mount.host_path, dir_fd, name, flags, mount.container_path, recursive=mount.recursive)

    def _make_target(self, dir_fd: int, name: str, directory: bool) -> posix.stat_result | None:
        """An empty file or directory to mount on (None); what is there when another container's hook on a
        shared rootfs made it meanwhile (its stat: checked as any existing target, and not ours to undo)."""
        try:
            if directory:
                posix.mkdir(name, 0o755, dir_fd=dir_fd)
                self.undo.add(lambda: posix.rmdir(name, dir_fd=dir_fd))
            else:
                posix.close(posix.open(name, atomicfile.NEW_FILE, 0o644, dir_fd=dir_fd))
                self.undo.add(lambda: posix.unlink(name, dir_fd=dir_fd))
        except FileExistsError:
            return posix.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return None

    def _mount_on(self, source: str, dir_fd: int, name: str, flags: int, shown: str, *,
                  recursive: bool = False) -> str | None:
        """Mount `source` on `name`; how, when the kernel lacks the new mount API."""
        target = posix.open(name, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if self._in_shared_mount(target):
                raise HookError(f"mount {shown}: the target is inside a shared mount, so the mount would "
                                "propagate to the host; give that volume private or slave propagation")
            if self.mount_api:
                try:
                    self._attach_sealed(source, target, flags, recursive)
                except OSError as err:
                    if err.errno != errno.ENOSYS:
                        raise HookError(f"mount {source} on {shown}: {posix.strerror(err.errno or 0)}") from None
                    self.mount_api = False
                else:
                    self.undo.add(lambda: self._unmount(dir_fd, name))
                    return None
            try:
                syscalls.mount(source, _proc_fd(target), syscalls.MS_BIND | syscalls.MS_REC * recursive)
            except OSError as err:
                raise HookError(f"mount {source} on {shown}: {posix.strerror(err.errno or 0)}") from None
        finally:
            posix.close(target)
        self.undo.add(lambda: self._unmount(dir_fd, name))
        # Old kernels only: a bind mount ignores MS_RDONLY & co., so remount the new mount (reopened by name).
        fd = posix.open(name, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=dir_fd)
        try:
            syscalls.mount(None, _proc_fd(fd), syscalls.MS_REMOUNT | syscalls.MS_BIND | flags)
        except OSError as err:
            raise HookError(f"remount {shown} read-only: {posix.strerror(err.errno or 0)}") from None
        finally:
            posix.close(fd)
        return "kernel lacks open_tree/mount_setattr: bound, then remounted read-only"

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
            posix.close(tree)

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
            from devinject.linux.mountinfo import parse_mountinfo

            self._shared.update((m.mount_id, m.shared) for m in parse_mountinfo(mountinfo, mount_id=mount_id))
        return self._shared.get(mount_id, False)

    @staticmethod
    def _unmount(dir_fd: int, name: str) -> None:
        fd = posix.open(name, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=dir_fd)
        try:
            syscalls.umount(_proc_fd(fd))
        finally:
            posix.close(fd)

    # --- links and the linker cache -----------------------------------------------------------------
    def symlink(self, link: Symlink) -> str | None:
        dir_fd, name = self.root.walk_parent(link.link, create=True, created=self.created)
        self.undo.keep(dir_fd)
        try:
            posix.symlink(link.target, name, dir_fd=dir_fd)  # the usual case: nothing there yet
        except FileExistsError:
            try:
                if posix.readlink(name, dir_fd=dir_fd) == link.target:
                    return "present"  # made by an earlier run of the hook for this container
            except OSError:  # not a link
                in_way = posix.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if self._is_target(in_way, link):
                    # the link's own target, mounted there already (a device plugin's Allocate answer
                    # mounts what this hook would link, for runtimes without CDI): the container has it
                    return "its target is mounted there already"
                if stat.S_ISDIR(in_way.st_mode):
                    raise HookError(f"link {link.link}: a directory is in the way in the container") from None
            # an image file or link in the way: replace it atomically, never write through it
            tmp = f".{name}.devinject-{posix.getpid()}"
            posix.symlink(link.target, tmp, dir_fd=dir_fd)
            try:
                posix.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError as err:
                posix.unlink(tmp, dir_fd=dir_fd)
                if err.errno == errno.EBUSY:
                    raise HookError(f"link {link.link}: another file is mounted there in the container") from None
                raise
        self.undo.add(lambda: posix.unlink(name, dir_fd=dir_fd))
        return None

    def _is_target(self, in_way: posix.stat_result, link: Symlink) -> bool:
        """Whether `in_way` (what stands at the link's path) is the very file the link would name, resolved
        in the container's root."""
        target = link.target if link.target.startswith("/") else \
            purepath.join(purepath.dirname(link.link), link.target)
        try:
            dir_fd, name = self.root.resolve(purepath.normpath(target))
        except (UnsafePathError, OSError):
            return False
        try:
            st = posix.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        finally:
            posix.close(dir_fd)
        return (st.st_dev, st.st_ino) == (in_way.st_dev, in_way.st_ino)

    def _is_musl(self) -> str | None:
        for lib in ("/lib", "/usr/lib"):
            fd = self.root.open_dir(lib)
            if fd is None:
                continue
            try:
                loaders = [n for n in posix.listdir(fd) if n.startswith("ld-musl-") and n.endswith(".so.1")]
            finally:
                posix.close(fd)
            if loaders:
                return loaders[0][len("ld-musl-"):-len(".so.1")]
        return None

    def _forward_compat(self, compat: ForwardCompat) -> str | None:
        """How `compat.directory` goes first, when the image carries a newer `library` there than the host
        driver (its libraries must then be found first), else None. Names only: nothing from the image is
        opened."""
        dir_fd = self.root.open_dir(compat.directory)
        if dir_fd is None:
            return None
        try:
            names = posix.listdir(dir_fd)
        finally:
            posix.close(dir_fd)
        prefix = compat.library + "."
        versions = [n[len(prefix):] for n in names if n.startswith(prefix)]
        newer = [v for v in versions if newer_than(v, compat.host_version)]
        if not newer:
            return None
        return f"forward compat {compat.directory} first ({compat.library} {max(newer)} > {compat.host_version})"

    def update_ldcache(self, folders: tuple[str, ...], compat: tuple[ForwardCompat, ...] = ()) -> str | None:
        firsts = [(c.directory, how) for c in compat if (how := self._forward_compat(c))]
        folders = tuple(dict.fromkeys((*(d for d, _ in firsts), *folders)))  # the image's newer libraries win ties
        hows = [how for _, how in firsts]
        musl_arch = self._is_musl()
        if musl_arch:
            hows.append(self._write_musl_path(musl_arch, folders))
            return ", ".join(hows)
        etc_fd, name, previous = linkercache.update(self.root, folders, self.created, self.sonames)
        self.undo.keep(etc_fd)
        if previous is None:
            self.undo.add(lambda: posix.unlink(name, dir_fd=etc_fd))
        else:
            self.undo.add(lambda: atomicfile.replace_at(etc_fd, name, previous))
        return ", ".join(hows) or None

    def write_application_profile(self, gpu_minors: tuple[int, ...]) -> str | None:
        """The profile file, replaced atomically (an image's file or link there is replaced, never written
        through), its directories made in-root 0555 and itself 0444, as NVIDIA's hook makes them. A read-only
        /etc or /etc/nvidia (a ConfigMap mounted there) leaves the container without it rather than unstarted:
        EGL and Vulkan then see every GPU the container was given, which are its GPUs all the same."""
        made = len(self.created.dirs)
        try:
            dir_fd, name = self.root.walk_parent(APPLICATION_PROFILE, create=True, created=self.created)
        except UnsafePathError as err:
            if posix.strerror(errno.EROFS) in err.message:
                return "not written: read-only file system"
            raise
        self.undo.keep(dir_fd)
        for parent_fd, made_name in self.created.dirs[made:]:
            if made_name in _PROFILE_DIRS:  # not an /etc made on the way, which the linker cache writes into
                fd = posix.open(made_name, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_NOFOLLOW | posix.O_CLOEXEC,
                                dir_fd=parent_fd)
                try:
                    posix.fchmod(fd, 0o555)
                finally:
                    posix.close(fd)
        previous_fd = linkercache.open_regular(dir_fd, name)
        previous = None
        if previous_fd is not None:
            with open(previous_fd, "rb") as handle:
                previous = handle.read(1 << 16)
        try:
            atomicfile.replace_at(dir_fd, name, application_profile(gpu_minors), 0o444)
        except OSError as err:
            if err.errno == errno.EROFS:
                return "not written: read-only file system"
            raise
        if previous is None:
            self.undo.add(lambda: posix.unlink(name, dir_fd=dir_fd))
        else:
            self.undo.add(lambda: atomicfile.replace_at(dir_fd, name, previous, 0o444))
        return None

    def _write_musl_path(self, arch: str, folders: tuple[str, ...]) -> str:
        dir_fd, name = self.root.walk_parent(f"/etc/ld-musl-{arch}.path", create=True, created=self.created)
        try:
            fd = linkercache.open_regular(dir_fd, name)
            if fd is None:
                existing = ["/lib", "/usr/local/lib", "/usr/lib"]  # musl's built-in default
            else:
                with open(fd) as handle:
                    existing = [line.strip() for line in handle.read(65536).splitlines() if line.strip()]
            wanted = list(dict.fromkeys([*existing, *folders]))
            atomicfile.replace_at(dir_fd, name, ("\n".join(wanted) + "\n").encode())
        finally:
            posix.close(dir_fd)
        return f"musl: /etc/ld-musl-{arch}.path {' '.join(folders)}"

    # --- whole plan: Steps.apply ---------------------------------------------------------------------
    def close(self) -> None:
        self.undo.close()
        self.root.close()
        self.created.close()

    def rollback(self) -> None:
        self.undo.rollback()
        for dir_fd, name in reversed(self.created.dirs):
            try:
                posix.rmdir(name, dir_fd=dir_fd)
            except OSError:
                pass
