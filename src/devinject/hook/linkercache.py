"""The container's /etc/ld.so.cache, written by devinject through the pinned rootfs.

No host binary is pointed at the rootfs: `ldconfig -r` chroots and then follows the image's links by itself,
and before `pivot_root` the container's `/proc/1/root` is the host's `/` (an image with `/etc ->
/proc/1/root/<dir>` got its cache written on the host). Here every path goes through `safepath`, files are
opened `O_PATH | O_NOFOLLOW` and only regular files are read, and the new cache replaces the old one with
a rename inside the resolved `/etc`.

The cache is the image's own (kept as it is, so the image's libraries resolve as before) with the libraries
found in the requested folders on top, sorted the way ld.so's binary search needs.
"""

from __future__ import annotations

import os
import posixpath
import stat

from devinject.core.atomicfile import replace_at
from devinject.core.elfinfo import read_shared_object
from devinject.core.errors import HookError, LdCacheError, UnsafePathError
from devinject.core.ldcache import MAX_CACHE_BYTES, LdCacheEntry, build_ldcache, merge_entries, parse_ldcache
from devinject.hook.safepath import _O_PATH, Created, Root

CACHE_PATH = "/etc/ld.so.cache"
MAX_FOLDER_ENTRIES = 8192


def open_regular(dir_fd: int, name: str) -> int | None:
    """A read fd on `name` in `dir_fd` when it is a regular file (never a link, FIFO or device: opening a
    device node can have side effects); None otherwise."""
    try:
        path_fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(path_fd).st_mode):
            return None
        return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(path_fd)


def _read_existing(etc_fd: int, name: str) -> tuple[list[LdCacheEntry], bytes | None]:
    """The image's cache entries and its bytes (None when it has no cache file)."""
    fd = open_regular(etc_fd, name)
    if fd is None:
        return [], None
    try:
        data = os.read(fd, MAX_CACHE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CACHE_BYTES:
        return [], data
    try:
        return parse_ldcache(data), data
    except LdCacheError:
        return [], data  # ld.so ignores a broken cache too: start from an empty one


def _already_cached(name: str, folder: str, paths: set[str], sonames: set[str]) -> bool:
    """An image library the image's own cache already covers: the SONAME link itself, or a real file
    named after a cached SONAME (`libz.so.1.2.13` under `libz.so.1`). Saves reading every ELF header of
    a large library directory on each container start."""
    if f"{folder}/{name}" in paths:
        return True
    parts = name.split(".")
    return any(".".join(parts[:k]) in sonames for k in range(2, len(parts)))


def _names_a_sibling(dir_fd: int, name: str, present: set[str]) -> bool:
    """`name` is a link to another library name in the same folder (each library is read once, under the
    name that is a file, not again through every link to it)."""
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return "/" not in target and target != name and ".so" in target and target in present


def libraries_in(root: Root, folder: str, existing: list[LdCacheEntry]) -> list[LdCacheEntry]:
    """Cache entries for the shared libraries in the container's `folder` (resolved in-root)."""
    folder = posixpath.normpath(folder)
    dir_fd = root.open_dir(folder)
    if dir_fd is None:
        return []  # the folder is not in the container: nothing to add
    try:
        with os.scandir(dir_fd) as listing:  # each entry's type from the listing itself: no stat for a link
            links = {entry.name: entry.is_symlink() for entry in listing}
        names = sorted(links)[:MAX_FOLDER_ENTRIES]
        present = set(names)
        paths = {e.path for e in existing}
        sonames = {e.soname for e in existing if posixpath.dirname(e.path) == folder}
        found: list[LdCacheEntry] = []
        for name in names:
            if ".so" not in name or _already_cached(name, folder, paths, sonames):
                continue
            if links[name] and _names_a_sibling(dir_fd, name, present):
                continue  # libcuda.so -> libcuda.so.1: the library it names is read under that name
            fd = open_regular(dir_fd, name)
            if fd is None:  # a link elsewhere: follow it inside the rootfs only
                try:
                    link_dir, link_leaf = root.resolve(f"{folder}/{name}")
                except UnsafePathError:
                    continue
                try:
                    fd = open_regular(link_dir, link_leaf)
                finally:
                    os.close(link_dir)
                if fd is None:
                    continue
            try:
                library = read_shared_object(fd)
            finally:
                os.close(fd)
            if library is not None and library.soname in present:
                found.append(LdCacheEntry(library.soname, f"{folder}/{library.soname}", library.flags, 0))
        return list(dict.fromkeys(found))
    finally:
        os.close(dir_fd)


def update(root: Root, folders: tuple[str, ...], created: Created) -> tuple[int, str, bytes | None]:
    """Write the container's cache; returns (the /etc fd, the file name, the previous bytes) for undo."""
    etc_fd, name = root.walk_parent(CACHE_PATH, create=True, created=created)
    try:
        existing, previous = _read_existing(etc_fd, name)
        added: list[LdCacheEntry] = []
        for folder in folders:
            added += libraries_in(root, folder, existing)
        replace_at(etc_fd, name, build_ldcache(merge_entries(existing, added)))
    except OSError as err:
        os.close(etc_fd)
        raise HookError(f"update-ldcache: {CACHE_PATH}: {err.strerror}") from None
    except BaseException:
        os.close(etc_fd)
        raise
    return etc_fd, name, previous
