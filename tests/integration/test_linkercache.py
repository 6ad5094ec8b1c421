"""The container linker cache devinject writes itself: the same entries in the same order as the real
`ldconfig`, loadable by the real glibc loader, and never written outside the rootfs."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from devinject.hook import linkercache
from devinject.hook.executor import Executor
from devinject.hook.linkercache import SonameMemo, libraries_in
from devinject.hook.plan import Plan
from devinject.linux.elfinfo import read_shared_object
from devinject.linux.ldcache import (
    ARCH_X86_64,
    FLAG_ELF_LIBC6,
    LdCacheEntry,
    build_ldcache,
    libcmp_key,
    merge_entries,
    parse_ldcache,
)
from devinject.linux.safepath import Root
from tests.e2e.conftest import require

# Names that exercise every rule of _dl_cache_libcmp: numeric runs, digits against letters, prefixes, case.
SONAMES = ("libx.so.1", "libx.so.2", "libx.so.10", "liba9.so.1", "liba10.so.1", "libfoo-1.2.so.3", "libFoo.so.1",
           "libz.so.1", "lib_a.so.1", "libx2.so.0", "libxa.so.0", "libx.so", "libA.so.05")
X86_64 = ARCH_X86_64 | FLAG_ELF_LIBC6


def _c_symbol(soname: str) -> str:
    return "f_" + "".join(ch if ch.isalnum() else "_" for ch in soname)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real library per SONAME (file `<soname>.0.0` plus its SONAME link), built with gcc."""
    require(shutil.which("gcc") is not None, "gcc not installed (make system-deps)")
    out = tmp_path_factory.mktemp("libs")
    for soname in SONAMES:
        source = out / f"{_c_symbol(soname)}.c"
        source.write_text(f"int {_c_symbol(soname)}(void) {{ return 1; }}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out / f"{soname}.0.0"),
                        str(source)], check=True)
        source.unlink()
        (out / soname).symlink_to(f"{soname}.0.0")
    return out


def _rootfs(tmp_path: Path, libraries: Path, folder: str = "opt/vendor/lib") -> Path:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    shutil.copytree(libraries, rootfs / folder, symlinks=True)
    return rootfs


def test_entries_and_order_match_the_real_ldconfig(tmp_path: Path, libraries: Path) -> None:
    require(shutil.which("ldconfig") is not None, "ldconfig not installed")
    rootfs = _rootfs(tmp_path, libraries)
    subprocess.run(["ldconfig", "-r", str(rootfs), "-X", "-C", "/etc/ld.so.cache", "/opt/vendor/lib"], check=True,
                   env={"PATH": "/usr/sbin:/sbin:/usr/bin:/bin"})
    theirs = [e for e in parse_ldcache((rootfs / "etc/ld.so.cache").read_bytes())
              if e.path.startswith("/opt/vendor/lib/")]
    with Root(str(rootfs)) as root:
        ours = merge_entries([], libraries_in(root, "/opt/vendor/lib", []))
    assert [(e.soname, e.path, e.flags) for e in ours] == [(e.soname, e.path, e.flags) for e in theirs]
    assert len(ours) == len(SONAMES)


def _linker_names(folder: Path, libraries: Path) -> None:
    """Every shape of link a driver install or the spec's create-symlinks leaves beside the libraries: the
    unversioned `.so` through the SONAME link (libx.so -> libx.so.1 -> file) and straight to the file, one
    that names another library (listed as that SONAME), a dangling one, one to a non-library, a loop, one
    that leaves the folder, and names no prefix of their SONAME."""
    shutil.copytree(libraries, folder, symlinks=True)
    (folder / "libx.so").unlink()  # SONAMES' own unversioned library becomes the link a -dev package adds
    (folder / "libx.so").symlink_to("libx.so.10")
    (folder / "liba9.so").symlink_to("liba9.so.1.0.0")
    (folder / "libFoo.so").symlink_to("libFoo.so.1")
    (folder / "libGL.so").symlink_to("libz.so.1")  # not a prefix of libz.so.1: listed as libz.so.1
    (folder / "libcompat.so.1").symlink_to("libz.so.1.0.0")
    (folder / "libgone.so").symlink_to("libgone.so.1")
    (folder / "libtext.so").symlink_to("notes.so.txt")
    (folder / "notes.so.txt").write_text("not a library\n")
    (folder / "libloop.so").symlink_to("libloop.so.1")
    (folder / "libloop.so.1").symlink_to("libloop.so")
    (folder / "libxa.so").symlink_to("../../../opt/elsewhere/libxa.so.0.0")
    (folder.parent.parent.parent / "opt" / "elsewhere").mkdir(parents=True)
    shutil.copy(libraries / "libxa.so.0.0.0", folder.parent.parent.parent / "opt" / "elsewhere" / "libxa.so.0.0")


def test_unversioned_links_are_listed_as_the_real_ldconfig_lists_them(tmp_path: Path, libraries: Path) -> None:
    """`dlopen("libcuda.so")` finds the library through the cache only when the cache lists that name, as
    ldconfig (and NVIDIA's update-ldcache, which runs it) does; each link shape against the real ldconfig."""
    require(shutil.which("ldconfig") is not None, "ldconfig not installed")
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    _linker_names(rootfs / "opt" / "vendor" / "lib", libraries)
    subprocess.run(["ldconfig", "-r", str(rootfs), "-X", "-C", "/etc/ld.so.cache", "/opt/vendor/lib"], check=True,
                   env={"PATH": "/usr/sbin:/sbin:/usr/bin:/bin"}, capture_output=True)
    theirs = [e for e in parse_ldcache((rootfs / "etc/ld.so.cache").read_bytes())
              if e.path.startswith("/opt/vendor/lib/")]
    with Root(str(rootfs)) as root:
        ours = merge_entries([], libraries_in(root, "/opt/vendor/lib", []))
    assert [(e.soname, e.path, e.flags) for e in ours] == [(e.soname, e.path, e.flags) for e in theirs]
    assert {"libx.so", "liba9.so", "libFoo.so", "libxa.so"} <= {e.soname for e in ours}


def test_real_glibc_loader_finds_every_library_through_the_written_cache(tmp_path: Path, libraries: Path) -> None:
    """ld.so binary-searches the cache: a wrong order loses libraries. A program linked against all of
    them runs in a chroot whose only way to find them is the cache devinject wrote."""
    require(os.geteuid() == 0 and shutil.which("gcc") is not None, "needs root (chroot) and gcc")
    rootfs = _rootfs(tmp_path, libraries)
    for source in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):
        target = rootfs / source.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(source).resolve(), target)
    calls = "".join(f"{_c_symbol(s)}() + " for s in SONAMES)
    decls = "".join(f"int {_c_symbol(s)}(void);\n" for s in SONAMES)
    (tmp_path / "main.c").write_text(f'#include <stdio.h>\n{decls}int main(void) {{ printf("%d\\n", {calls}0); }}\n')
    links = [f"-l:{soname}" for soname in SONAMES]
    (rootfs / "bin").mkdir()
    subprocess.run(["gcc", "-o", str(rootfs / "bin/prog"), str(tmp_path / "main.c"), f"-L{libraries}", *links],
                   check=True)
    Executor(str(rootfs)).apply(Plan(ldcache_folders=("/opt/vendor/lib",)))
    done = subprocess.run(["chroot", str(rootfs), "/bin/prog"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(SONAMES))


def test_the_images_own_entries_are_kept_and_the_injected_one_wins(tmp_path: Path, libraries: Path) -> None:
    rootfs = _rootfs(tmp_path, libraries)
    image = [LdCacheEntry("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6", X86_64, 0),
             LdCacheEntry("libx.so.1", "/usr/lib/stale/libx.so.1", X86_64, 0)]
    (rootfs / "etc/ld.so.cache").write_bytes(build_ldcache(merge_entries([], image)))
    Executor(str(rootfs)).apply(Plan(ldcache_folders=("/opt/vendor/lib",)))
    cache = {e.soname: e.path for e in parse_ldcache((rootfs / "etc/ld.so.cache").read_bytes())}
    assert cache["libc.so.6"] == "/lib/x86_64-linux-gnu/libc.so.6"
    assert cache["libx.so.1"] == "/opt/vendor/lib/libx.so.1"
    assert oct((rootfs / "etc/ld.so.cache").stat().st_mode & 0o777) == "0o644"


def test_links_in_the_image_never_lead_the_cache_outside_the_rootfs(tmp_path: Path, libraries: Path) -> None:
    """/etc and the library folder are links to absolute host paths: both resolve inside the rootfs."""
    outside = tmp_path / "host-dir"
    outside.mkdir()
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "etc").symlink_to(str(outside))
    (rootfs / "opt").symlink_to(f"/../../..{libraries}")
    Executor(str(rootfs)).apply(Plan(ldcache_folders=("/opt",)))
    assert list(outside.iterdir()) == []
    written = parse_ldcache((rootfs / str(outside).lstrip("/") / "ld.so.cache").read_bytes())
    assert written == []  # /opt resolved to <rootfs>/<libraries>, which does not exist in the image
    assert sorted(p.name for p in libraries.iterdir()) == sorted([*SONAMES, *(f"{s}.0.0" for s in SONAMES)])


def test_a_failed_hook_restores_the_images_cache(tmp_path: Path, libraries: Path) -> None:
    from devinject.core.errors import HookError
    from devinject.hook.plan import BindMount

    rootfs = _rootfs(tmp_path, libraries)
    original = build_ldcache([LdCacheEntry("libc.so.6", "/lib/libc.so.6", X86_64, 0)])
    (rootfs / "etc/ld.so.cache").write_bytes(original)
    executor = Executor(str(rootfs))
    executor.update_ldcache(("/opt/vendor/lib",))
    assert (rootfs / "etc/ld.so.cache").read_bytes() != original
    executor.rollback()
    assert (rootfs / "etc/ld.so.cache").read_bytes() == original
    fresh = _rootfs(tmp_path / "second", libraries)
    with pytest.raises(HookError):  # the mount fails after nothing else: the cache it wrote is gone again
        Executor(str(fresh)).apply(Plan(mounts=(BindMount(str(tmp_path / "absent"), "/x"),),
                                        ldcache_folders=("/opt/vendor/lib",)))
    assert not (fresh / "etc/ld.so.cache").exists()


def _dl_cache_libcmp(a: str, b: str) -> int:
    """glibc's comparison, transcribed, to check the sort key against."""
    i = j = 0
    while i < len(a):
        if a[i].isdigit():
            if j < len(b) and b[j].isdigit():
                x = i
                while i < len(a) and a[i].isdigit():
                    i += 1
                y = j
                while j < len(b) and b[j].isdigit():
                    j += 1
                if int(a[x:i]) != int(b[y:j]):
                    return int(a[x:i]) - int(b[y:j])
            else:
                return 1
        elif j < len(b) and b[j].isdigit():
            return -1
        elif j >= len(b) or a[i] != b[j]:
            return ord(a[i]) - (ord(b[j]) if j < len(b) else 0)
        else:
            i += 1
            j += 1
    return 0 - (ord(b[j]) if j < len(b) else 0)


def test_sort_key_agrees_with_glibcs_comparison() -> None:
    rng = random.Random(7)
    alphabet = "ab.-_019"
    names = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(400)] + list(SONAMES)
    for a, b in zip(names, reversed(names), strict=True):
        expected = (_dl_cache_libcmp(a, b) > 0) - (_dl_cache_libcmp(a, b) < 0)
        assert ((libcmp_key(a) > libcmp_key(b)) - (libcmp_key(a) < libcmp_key(b))) == expected, (a, b)


def test_written_cache_round_trips_and_drops_hwcaps_entries() -> None:
    hwcaps = LdCacheEntry("libx.so.1", "/usr/lib/glibc-hwcaps/x86-64-v3/libx.so.1", X86_64, (1 << 62) | 0)
    plain = LdCacheEntry("libx.so.1", "/usr/lib/libx.so.1", X86_64, 0)
    other = LdCacheEntry("libother.so.2", "/elsewhere/liboddname.so", X86_64, 0)  # key not a path suffix
    merged = merge_entries([hwcaps, plain, other], [])
    assert merged == [plain, other]
    assert parse_ldcache(build_ldcache(merged)) == merged


def test_elf_reader_takes_real_libraries_and_refuses_everything_else(tmp_path: Path, libraries: Path) -> None:
    fd = os.open(libraries / "libx.so.10.0.0", os.O_RDONLY)
    try:
        assert read_shared_object(fd) == ("libx.so.10", X86_64)
    finally:
        os.close(fd)
    real = (libraries / "libz.so.1.0.0").read_bytes()
    samples = {
        "empty": b"", "text": b"not an elf at all" * 10, "truncated": real[:80],
        "huge-phnum": real[:56] + b"\xff\xff" + real[58:], "big-endian": real[:5] + b"\x02" + real[6:],
        "no-dynamic": real[:64],
    }
    for name, data in samples.items():
        path = tmp_path / name
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert read_shared_object(fd) is None, name
        finally:
            os.close(fd)
    fd = os.open(shutil.which("busybox") or "/bin/sh", os.O_RDONLY)  # an executable has no SONAME
    try:
        assert read_shared_object(fd) is None
    finally:
        os.close(fd)


def test_the_soname_memo_survives_a_broken_file_and_stays_bounded(tmp_path: Path, libraries: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo only saves time: an unreadable one is an empty one, and a full one keeps what was used."""
    memo_file = tmp_path / "sonames.json"
    library = os.stat(libraries / "libx.so.1.0.0")
    key = SonameMemo.key(library)
    malformed = [{key: value} for value in ("libx.so.1", ["libx.so.1"], [1, 2], ["libx.so.1", "771"], None)]
    for broken in (b"{not json", b"[1, 2]", b"\xff\xfe", *(json.dumps(m).encode() for m in malformed)):
        memo_file.write_bytes(broken)
        assert SonameMemo.load(str(memo_file)).recall(library) is None, broken
    memo_file.write_text(json.dumps({key: ["libx.so.1", X86_64]}))
    assert SonameMemo.load(str(memo_file)).recall(library) == ("libx.so.1", X86_64)
    assert SonameMemo.load(str(tmp_path / "absent.json")).known == {}
    monkeypatch.setattr(linkercache, "MAX_REMEMBERED", 3)
    memo = SonameMemo({f"old{i}": ["libold.so.1", X86_64] for i in range(3)})
    memo.learn(library, linkercache.SharedObject("libx.so.1", X86_64))
    memo.save(str(memo_file))
    assert json.loads(memo_file.read_text()) == {key: ["libx.so.1", X86_64]}
    SonameMemo(json.loads(memo_file.read_text())).save(str(tmp_path / "unchanged.json"))
    assert not (tmp_path / "unchanged.json").exists()  # nothing learned: nothing written


def test_a_huge_image_folder_costs_the_hook_no_more_memory_than_its_cut(tmp_path: Path, libraries: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An image may fill a folder the spec names with any number of entries; the hook reads the first
    MAX_FOLDER_ENTRIES names in sorted order and holds no more than twice that many at a time (a hook server's
    worker serves one request after another). Here the cut is 100 and the folder holds 20,000 files: the
    libraries sorted first are found as before, and the listing's peak is a fraction of the whole folder's."""
    import tracemalloc

    rootfs = _rootfs(tmp_path, libraries)
    folder = rootfs / "opt/vendor/lib"
    for index in range(20_000):
        (folder / f"zz-filler-{index:05d}-{'x' * 40}").touch()  # sorted after every library
    monkeypatch.setattr(linkercache, "MAX_FOLDER_ENTRIES", 100)
    with Root(str(rootfs)) as root:
        tracemalloc.start()
        try:
            found = libraries_in(root, "/opt/vendor/lib", [])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert sorted(e.soname for e in found) == sorted(SONAMES)
    assert peak < 400_000, f"{peak} bytes at the peak of listing 20,000 names cut to 100"


def test_first_entries_are_the_sorted_listings_first() -> None:
    class Entry:
        def __init__(self, name: str) -> None:
            self.name = name

        def is_symlink(self) -> bool:
            return self.name.endswith("7")

    names = [f"lib{n}.so" for n in range(1000)]
    random.Random(7).shuffle(names)
    for limit in (1, 3, 100, 499, 500, 1000, 5000):
        kept = linkercache.first_entries([Entry(n) for n in names], limit)  # type: ignore[misc]
        assert list(kept) == sorted(names)[:limit]
        assert all(kept[n] == n.endswith("7") for n in kept)
