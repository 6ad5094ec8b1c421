"""Carries out a plan inside the container's mount namespace (before pivot_root, so host paths still
resolve), recording an undo step for everything it changes. Every container path goes through `safepath`."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from devinject.errors import HookError, UnsafePathError
from devinject.hook import syscalls
from devinject.hook.plan import BindMount, MakeNode, Plan, Symlink
from devinject.hook.safepath import _O_PATH, Created, Root

LDCONFIG_CANDIDATES = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
LDCONFIG_TIMEOUT = 10
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def run_bounded(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """posix_spawn `argv` (stdin/stdout /dev/null, stderr captured); (exit status or None on timeout, stderr).

    Not subprocess: its imports alone cost the hook ~3 ms per container start.
    """
    import select
    import time

    read_end, write_end = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    try:
        pid = os.posix_spawn(argv[0], argv, env, file_actions=[
            (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, write_end, 2)])
    finally:
        os.close(write_end)
        os.close(null)
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    try:
        while True:
            remaining = deadline - time.monotonic()
            ready = select.select([read_end], [], [], max(remaining, 0))[0]
            if not ready:
                os.kill(pid, syscalls.SIGKILL)
                os.waitpid(pid, 0)
                return None, b"".join(chunks).decode(errors="replace")
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            if sum(map(len, chunks)) < 1 << 20:
                chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


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


_NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def _proc_fd(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


class Executor:
    def __init__(self, rootfs: str) -> None:
        self.rootfs = rootfs
        self.root = Root(rootfs)
        self.undo = Undo()
        self.created = Created()
        self.log: list[str] = []

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
        try:
            os.mknod(name, kind | node.mode, rdev, dir_fd=dir_fd)
        except PermissionError:
            self._bind_node(node, dir_fd, name)  # user namespace: mknod is not permitted
            return
        self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        os.chown(name, node.uid, node.gid, dir_fd=dir_fd, follow_symlinks=False)
        os.chmod(name, node.mode, dir_fd=dir_fd)
        self.log.append(f"mknod {node.path} {node.type} {node.major}:{node.minor}")

    def _bind_node(self, node: MakeNode, dir_fd: int, name: str) -> None:
        os.close(os.open(name, _NEW_FILE, 0o644, dir_fd=dir_fd))
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
        try:
            target = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            target = None
        if target is None:
            if stat.S_ISDIR(source.st_mode):
                os.mkdir(name, 0o755, dir_fd=dir_fd)
                self.undo.add(lambda: os.rmdir(name, dir_fd=dir_fd))
            else:
                os.close(os.open(name, _NEW_FILE, 0o644, dir_fd=dir_fd))
                self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        elif (target.st_dev, target.st_ino) == (source.st_dev, source.st_ino):
            self.log.append(f"mount {mount.container_path} present")
            return  # the hook already ran for this container: never stack a second mount
        elif stat.S_ISDIR(target.st_mode) != stat.S_ISDIR(source.st_mode):
            raise HookError(f"mount {mount.container_path}: file/directory mismatch with {mount.host_path}")
        flags = (syscalls.MS_RDONLY * mount.readonly | syscalls.MS_NOSUID * mount.nosuid
                 | syscalls.MS_NODEV * mount.nodev | syscalls.MS_NOEXEC * mount.noexec)
        self._mount_on(mount.host_path, dir_fd, name, flags, mount.container_path, recursive=mount.recursive)
        self.log.append(f"bind {mount.host_path} -> {mount.container_path}")

    def _mount_on(self, source: str, dir_fd: int, name: str, flags: int, shown: str, *,
                  recursive: bool = False) -> None:
        fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            syscalls.mount(source, _proc_fd(fd), syscalls.MS_BIND | syscalls.MS_REC * recursive)
        except OSError as err:
            raise HookError(f"mount {source} on {shown}: {os.strerror(err.errno or 0)}") from None
        finally:
            os.close(fd)
        self.undo.add(lambda: self._unmount(dir_fd, name))
        # A bind mount ignores MS_RDONLY & co.: remount the new mount (reopened by name) with the flags.
        fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            syscalls.mount(None, _proc_fd(fd), syscalls.MS_REMOUNT | syscalls.MS_BIND | flags)
        except OSError as err:
            raise HookError(f"remount {shown} read-only: {os.strerror(err.errno or 0)}") from None
        finally:
            os.close(fd)

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
            if os.readlink(name, dir_fd=dir_fd) == link.target:
                return
        except FileNotFoundError:
            pass
        except OSError:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise HookError(f"link {link.link}: a directory is in the way in the container") from None
        try:
            os.symlink(link.target, name, dir_fd=dir_fd)  # the usual case: nothing there yet
        except FileExistsError:  # an image file in the way: replace it atomically, never write through it
            tmp = f".{name}.devinject-{os.getpid()}"
            os.symlink(link.target, tmp, dir_fd=dir_fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        self.undo.add(lambda: os.unlink(name, dir_fd=dir_fd))
        self.log.append(f"symlink {link.link} -> {link.target}")

    def _is_musl(self) -> str | None:
        for lib in ("/lib", "/usr/lib"):
            try:
                dir_fd, name = self.root.resolve(lib)
            except UnsafePathError:
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                continue
            finally:
                os.close(dir_fd)
            try:
                loaders = [n for n in os.listdir(fd) if n.startswith("ld-musl-") and n.endswith(".so.1")]
            finally:
                os.close(fd)
            if loaders:
                return loaders[0][len("ld-musl-"):-len(".so.1")]
        return None

    def update_ldcache(self, folders: tuple[str, ...]) -> None:
        musl_arch = self._is_musl()
        if musl_arch:
            self._write_musl_path(musl_arch, folders)
            return
        ldconfig = next((p for p in LDCONFIG_CANDIDATES if os.access(p, os.X_OK)), None)
        if ldconfig is None:
            raise HookError("update-ldcache: no ldconfig on the host (" + ", ".join(LDCONFIG_CANDIDATES) + ")")
        etc_fd = self.root.walk_parent("/etc/ld.so.cache", create=True, created=self.created)[0]
        os.close(etc_fd)
        # The host's ldconfig (never the image's) chroots into the rootfs (-r); clean env, bounded time.
        command = [ldconfig, "-r", self.rootfs, "-C", "/etc/ld.so.cache", *folders]
        status, detail = run_bounded(command, CLEAN_ENV, LDCONFIG_TIMEOUT)
        if status is None:
            raise HookError(f"update-ldcache: ldconfig did not finish in {LDCONFIG_TIMEOUT}s")
        if status != 0:
            lines = detail.strip().splitlines()
            raise HookError(f"update-ldcache: ldconfig exited {status}: {lines[-1] if lines else ''}")
        self.log.append(f"ldconfig {' '.join(folders)}")

    def _write_musl_path(self, arch: str, folders: tuple[str, ...]) -> None:
        dir_fd, name = self.root.walk_parent(f"/etc/ld-musl-{arch}.path", create=True, created=self.created)
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                with os.fdopen(fd) as handle:
                    existing = [line.strip() for line in handle.read(65536).splitlines() if line.strip()]
            except FileNotFoundError:
                existing = ["/lib", "/usr/local/lib", "/usr/lib"]  # musl's built-in default
            wanted = list(dict.fromkeys([*existing, *folders]))
            tmp = f".{name}.devinject-{os.getpid()}"
            fd = os.open(tmp, _NEW_FILE, 0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as handle:
                handle.write("\n".join(wanted) + "\n")
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        self.log.append(f"musl path {' '.join(folders)}")

    # --- whole plan ----------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> list[str]:
        try:
            for node in plan.nodes:
                self.make_node(node)
            for mount in plan.mounts:
                self.bind_mount(mount)
            for link in plan.links:
                self.symlink(link)
            if plan.ldcache_folders:
                self.update_ldcache(plan.ldcache_folders)
        except (OSError, HookError) as err:
            self.rollback()
            if isinstance(err, HookError):
                raise
            raise HookError(f"{err.filename or 'container'}: {err.strerror}") from None
        finally:
            self.undo.close()
            self.root.close()
        return self.log

    def rollback(self) -> None:
        self.undo.rollback()
        for dir_fd, name in reversed(self.created.dirs):
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError:
                pass
        for dir_fd, _ in self.created.dirs:
            try:
                os.close(dir_fd)
            except OSError:
                pass
        self.created.dirs.clear()
