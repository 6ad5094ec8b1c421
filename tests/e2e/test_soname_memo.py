"""The linker cache's memo of library SONAMEs (hook/linkercache.py SonameMemo), on real bind mounts: host
libraries mounted into a rootfs on another filesystem, as a runtime's overlay is.

Each scenario runs in a private mount namespace of its own (`unshare -m`), as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import in_private_mount_ns, require

pytestmark = pytest.mark.live
SONAMES = ("liba.so.1", "libb.so.2", "libc-driver.so.550")

CONTAINERS = r"""
import json, os, shutil, subprocess, sys
from devinject.linux.ldcache import parse_ldcache
from devinject.hook.executor import Executor
from devinject.hook.linkercache import SonameMemo
from devinject.hook.plan import BindMount, Plan, Symlink

rootfs, libs, memo_file, image_lib = sys.argv[1:5]
files = sorted(n for n in os.listdir(libs) if n.endswith(".0.0"))

def container(memo):
    # a fresh rootfs on a filesystem of its own, as each container's overlay is
    subprocess.run(["mount", "-t", "tmpfs", "image", rootfs], check=True)
    os.makedirs(f"{rootfs}/etc")
    os.makedirs(f"{rootfs}/usr/lib")
    shutil.copy(image_lib, f"{rootfs}/usr/lib/libimage.so.1")  # the image's own library
    plan = Plan(mounts=tuple(BindMount(f"{libs}/{f}", f"/usr/lib/{f}") for f in files),
                links=tuple(Symlink(f, "/usr/lib/" + f[:-len(".0.0")]) for f in files),
                ldcache_folders=("/usr/lib",))
    Executor(rootfs, memo).apply(plan)
    with open(f"{rootfs}/etc/ld.so.cache", "rb") as cache:
        sonames = sorted(e.soname for e in parse_ldcache(cache.read()))
    subprocess.run(["umount", "-R", rootfs], check=True)
    memo.save(memo_file)
    return {"sonames": sonames, "learned": memo.learned, "remembered": len(memo.known)}

report = {"first": container(SonameMemo.load(memo_file))}
report["second"] = container(SonameMemo.load(memo_file))
poisoned = SonameMemo.load(memo_file)
poisoned.known[SonameMemo.key(os.stat(f"{libs}/{files[0]}"))] = ["", 0]  # "not a library"
report["poisoned"] = container(poisoned)
replaced = f"{libs}/{files[1]}"
shutil.copy(replaced, replaced + ".new")
os.replace(replaced + ".new", replaced)  # a driver update: the same name, another file
report["updated"] = container(SonameMemo.load(memo_file))
print(json.dumps(report))
"""


def _library(out: Path, soname: str, filename: str) -> Path:
    source = out / "lib.c"
    source.write_text("int f(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out / filename), str(source)],
                   check=True)
    source.unlink()
    return out / filename


def test_mounted_libraries_are_read_once_and_again_when_they_change(tmp_path: Path) -> None:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("gcc") is not None,
            "needs root, unshare and gcc")
    libs = tmp_path / "host-libs"
    libs.mkdir()
    for soname in SONAMES:
        _library(libs, soname, f"{soname}.0.0")
    image_lib = _library(tmp_path, "libimage.so.1", "libimage.so.1")
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    memo_file = tmp_path / "state" / "sonames.json"
    memo_file.parent.mkdir()
    done = in_private_mount_ns(CONTAINERS, str(rootfs), str(libs), str(memo_file), str(image_lib))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    everything = sorted([*SONAMES, "libimage.so.1"])
    # the first container reads the mounted libraries and remembers them; the image's own file is read but
    # not remembered (in an overlay it is a new file in every container)
    assert report["first"] == {"sonames": everything, "learned": True, "remembered": len(SONAMES)}
    # the second reads nothing: the same cache from the memo alone
    assert report["second"] == {"sonames": everything, "learned": False, "remembered": len(SONAMES)}
    # what the memo says is what the cache gets (so the memo really is what the second container used)
    assert report["poisoned"]["sonames"] == sorted([*SONAMES[1:], "libimage.so.1"])
    # a replaced library is a new identity: read again, and its entry is right
    assert report["updated"]["sonames"] == everything
    assert report["updated"]["learned"] is True
