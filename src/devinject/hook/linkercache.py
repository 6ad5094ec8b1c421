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

import posix  # not `os`, ~0.9 ms of imports: the hook runs this on every container start
import stat

from devinject.core import jsonlite
from devinject.core.atomicfile import replace_at
from devinject.core.errors import HookError, LdCacheError, UnsafePathError
from devinject.hook import purepath
from devinject.linux.elfinfo import SharedObject, read_shared_object
from devinject.linux.ldcache import MAX_CACHE_BYTES, LdCacheEntry, build_ldcache, merge_entries, parse_ldcache
from devinject.linux.safepath import _O_PATH, Created, Root

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from collections.abc import Iterable
    from os import DirEntry

CACHE_PATH = "/etc/ld.so.cache"
MAX_FOLDER_ENTRIES = 8192
MAX_REMEMBERED = 1024  # entries: ~100 KB, 0.5 ms to read on every start at most
NOT_A_LIBRARY = SharedObject("", 0)  # how the memo remembers a file that is no shared library


class SonameMemo:
    """SONAMEs and cache flags of libraries read on earlier container starts, by file identity (device,
    inode, size, mtime and ctime: a changed or replaced file is a new identity). The driver libraries a hook
    mounts are the same host files on every start; reading each one's ELF header costs ~40 us. Only files
    mounted in from another filesystem than their folder's are remembered (the host's); an image's own files
    are read every time (in an overlay they are new files in each container), so an image teaches it nothing.
    Kept in the hook's state dir (root's), loaded and saved outside the container's namespace."""

    def __init__(self, known: dict[str, object] | None = None) -> None:
        self.known = known if known is not None else {}
        self.used: set[str] = set()
        self.learned = False

    @staticmethod
    def key(st: posix.stat_result) -> str:
        from devinject.cdi.identity import file_identity  # here: a run without the memo (a cdi-hook) needs none

        return file_identity(st)

    def recall(self, st: posix.stat_result) -> SharedObject | None:
        """What the file with this identity was read as (NOT_A_LIBRARY for anything else); None when it was
        never read."""
        key = self.key(st)
        value = self.known.get(key)
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                and isinstance(value[1], int)):
            return None
        self.used.add(key)
        return SharedObject(value[0], value[1])

    def learn(self, st: posix.stat_result, library: SharedObject | None) -> None:
        key = self.key(st)
        self.known[key] = list(library or NOT_A_LIBRARY)
        self.used.add(key)
        self.learned = True

    @classmethod
    def load(cls, path: str) -> SonameMemo:
        """The memo saved at `path`; an empty one when there is none or it is unreadable (it only saves time)."""
        try:
            with open(path, encoding="utf-8") as handle:
                known = jsonlite.loads(handle.read())
        except (OSError, ValueError, UnicodeDecodeError):
            return cls()
        return cls(known if isinstance(known, dict) else None)

    def save(self, path: str) -> None:
        """Written back when this run read a library: all of it while small, else only what this run used."""
        if not self.learned:
            return
        kept = self.known if len(self.known) <= MAX_REMEMBERED else {
            key: value for key, value in self.known.items() if key in self.used}
        try:
            jsonlite.replace_file(path, kept)
        except OSError:
            pass  # a memo is an optimisation only


def open_regular(dir_fd: int, name: str) -> int | None:
    """A read fd on `name` in `dir_fd` when it is a regular file (never a link, FIFO or device: opening a
    device node can have side effects); None otherwise."""
    try:
        path_fd = posix.open(name, _O_PATH | posix.O_NOFOLLOW | posix.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(posix.fstat(path_fd).st_mode):
            return None
        return posix.open(f"/proc/self/fd/{path_fd}", posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        return None
    finally:
        posix.close(path_fd)


def _read_existing(etc_fd: int, name: str) -> tuple[list[LdCacheEntry], bytes | None]:
    """The image's cache entries and its bytes (None when it has no cache file)."""
    fd = open_regular(etc_fd, name)
    if fd is None:
        return [], None
    try:
        data = posix.read(fd, MAX_CACHE_BYTES + 1)
    finally:
        posix.close(fd)
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


def _sibling_named(dir_fd: int, name: str, present: set[str]) -> str | None:
    """The other library name in the same folder that the link `name` names, if it names one (each library
    is read once, under the name that is a file, not again through every link to it)."""
    try:
        target = posix.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None
    return target if "/" not in target and target != name and ".so" in target and target in present else None


def _is_linker_name(name: str, soname: str) -> bool:
    """`name` is a link ldconfig lists under its own name: the unversioned `.so` that `dlopen("libcuda.so")`
    and `ld -lcuda` ask for, a prefix of the SONAME it leads to (glibc's ldconfig, search_dir: a link that
    names neither its SONAME nor such a prefix is listed as its SONAME)."""
    return name != soname and name.endswith(".so") and soname.startswith(name)


def _through_siblings(name: str, siblings: dict[str, str], read: dict[str, SharedObject | None]) \
        -> tuple[bool, SharedObject | None]:
    """What the chain of sibling links from `name` ends at, when that file was read in this folder:
    (True, the library or None); (False, None) when it was not (a loop, or a file not read here)."""
    for _ in range(len(siblings) + 1):
        name = siblings.get(name, name)
        if name not in siblings:
            break
    return (True, read[name]) if name in read else (False, None)


def _read_library(fd: int, memo: SonameMemo | None, folder_dev: int) -> SharedObject | None:
    """The library open at `fd`, remembered by its identity when it was mounted in from another filesystem
    (the host's driver files; an image's own files have a new identity in each container's overlay) and
    nothing changed it while it was read."""
    if memo is None:
        return read_shared_object(fd)
    before = posix.fstat(fd)
    library = read_shared_object(fd)
    if before.st_dev != folder_dev and SonameMemo.key(posix.fstat(fd)) == SonameMemo.key(before):
        memo.learn(before, library)
    return library


def _recalled(dir_fd: int, name: str, memo: SonameMemo | None) -> SharedObject | None:
    """The memo's answer for the regular file `name` (never a link); None when it has none."""
    if memo is None:
        return None
    try:
        st = posix.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return memo.recall(st) if stat.S_ISREG(st.st_mode) else None


def _library(root: Root, folder: str, dir_fd: int, name: str, is_link: bool, memo: SonameMemo | None,
             folder_dev: int) -> SharedObject | None:
    """What the file `name` in `folder` is as a shared library, from the memo or read (a link elsewhere is
    followed inside the rootfs only); None when it is none."""
    recalled = None if is_link else _recalled(dir_fd, name, memo)
    if recalled is not None:
        return recalled if recalled != NOT_A_LIBRARY else None
    fd = open_regular(dir_fd, name)
    if fd is None:  # a link elsewhere: follow it inside the rootfs only
        try:
            link_dir, link_leaf = root.resolve(f"{folder}/{name}")
        except UnsafePathError:
            return None
        try:
            fd = open_regular(link_dir, link_leaf)
        finally:
            posix.close(link_dir)
        if fd is None:
            return None
    try:
        return _read_library(fd, memo, folder_dev)
    finally:
        posix.close(fd)


def first_entries(listing: Iterable[DirEntry[str]], limit: int) -> dict[str, bool]:
    """The first `limit` names of a folder's listing in sorted order, each with whether it is a link, holding
    at most 2 x `limit` names at any time: an image's folder of millions of entries costs the hook (and a hook
    server's worker, which serves one request after another) no more memory than one of 2 x `limit`."""
    kept: dict[str, bool] = {}
    for entry in listing:
        kept[entry.name] = entry.is_symlink()
        if len(kept) >= 2 * limit:
            kept = dict(sorted(kept.items())[:limit])
    return dict(sorted(kept.items())[:limit])


def libraries_in(root: Root, folder: str, existing: list[LdCacheEntry],
                 memo: SonameMemo | None = None) -> list[LdCacheEntry]:
    """Cache entries for the shared libraries in the container's `folder` (resolved in-root)."""
    folder = purepath.normpath(folder)
    dir_fd = root.open_dir(folder)
    if dir_fd is None:
        return []  # the folder is not in the container: nothing to add
    try:
        with posix.scandir(dir_fd) as listing:  # each entry's type from the listing itself: no stat for a link
            links = first_entries(listing, MAX_FOLDER_ENTRIES)
        names = list(links)
        present = set(names)
        paths = {e.path for e in existing}
        sonames = {e.soname for e in existing if purepath.dirname(e.path) == folder}
        folder_dev = posix.fstat(dir_fd).st_dev if memo is not None else -1
        found: list[LdCacheEntry] = []
        read: dict[str, SharedObject | None] = {}
        siblings: dict[str, str] = {}  # link -> the library name it names in this folder
        for name in names:
            if ".so" not in name or _already_cached(name, folder, paths, sonames):
                continue
            sibling = _sibling_named(dir_fd, name, present) if links[name] else None
            if sibling is not None:
                siblings[name] = sibling  # libcuda.so.1 -> libcuda.so.550.54.14: read under that name
                continue
            library = read[name] = _library(root, folder, dir_fd, name, links[name], memo, folder_dev)
            if library is not None and links[name] and _is_linker_name(name, library.soname):
                found.append(LdCacheEntry(name, f"{folder}/{name}", library.flags, 0))
            elif library is not None and library.soname in present:
                found.append(LdCacheEntry(library.soname, f"{folder}/{library.soname}", library.flags, 0))
        for name in siblings:  # libcuda.so -> libcuda.so.1 -> ...: listed as libcuda.so, as ldconfig lists it
            if not name.endswith(".so"):
                continue  # a link to another name is listed as the SONAME the file at its end has
            known, library = _through_siblings(name, siblings, read)
            if not known:
                library = _library(root, folder, dir_fd, name, True, memo, folder_dev)
            if library is not None and _is_linker_name(name, library.soname):
                found.append(LdCacheEntry(name, f"{folder}/{name}", library.flags, 0))
        return list(dict.fromkeys(found))
    finally:
        posix.close(dir_fd)


def update(root: Root, folders: tuple[str, ...], created: Created,
           memo: SonameMemo | None = None) -> tuple[int, str, bytes | None]:
    """Write the container's cache; returns (the /etc fd, the file name, the previous bytes) for undo."""
    etc_fd, name = root.walk_parent(CACHE_PATH, create=True, created=created)
    try:
        existing, previous = _read_existing(etc_fd, name)
        added: list[LdCacheEntry] = []
        for folder in folders:
            added += libraries_in(root, folder, existing, memo)
        replace_at(etc_fd, name, build_ldcache(merge_entries(existing, added)))
    except OSError as err:
        posix.close(etc_fd)
        raise HookError(f"update-ldcache: {CACHE_PATH}: {err.strerror}") from None
    except BaseException:
        posix.close(etc_fd)
        raise
    return etc_fd, name, previous
