"""A spec's CDI hook as generate writes it by default (specs/generate.py hook_command): this interpreter on the
hook launcher, `-IS`. Run as a runtime runs it, on a container state: one process makes the links, the
linker cache and the application profile of the container's GPUs, imports only what that needs (held here,
as tests/e2e/test_hook_edges.py holds the OCI hook's), and one with nothing to make returns before it reads
its state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from devinject.entry import worth_serving
from devinject.hook.plan import APPLICATION_PROFILE
from devinject.linux.ldcache import parse_ldcache
from devinject.specs.generate import hook_command

LIBDIR = "/usr/lib/x86_64-linux-gnu"
# Every devinject module a `links-and-ldcache` run imports (each is ~0.15 ms of a cold start): the OCI hook's
# (hook/main.py), the CDI model and its identities (the SONAME memo's, which a cdi-hook does not keep), the device
# cgroup rules (the plan's for the OCI hook), the C library (fastlibc, _ctypes), the mount table and the mount
# syscalls are not among them.
CDI_HOOK_MODULES = {
    "devinject", "devinject.entry", "devinject.hook", "devinject.hook.cdihook", "devinject.hook.fastjson",
    "devinject.hook.plan", "devinject.hook.purepath", "devinject.hook.executor", "devinject.hook.linkercache",
    "devinject.hook.state", "devinject.core", "devinject.core.jsonlite", "devinject.core.errors",
    "devinject.core.paths", "devinject.core.records", "devinject.core.atomicfile", "devinject.core.deadline",
    "devinject.linux", "devinject.linux.safepath", "devinject.linux.ldcache", "devinject.linux.elfinfo",
    "devinject.hook.client",  # no hook server answered: the socket client found none, and the hook ran here
}
NOT_IMPORTED = ("_ctypes", "ctypes", "json", "typing", "re", "enum", "dataclasses", "pathlib", "subprocess",
                "collections", "functools", "contextlib", "signal", "socket", "site", "yaml", "click",
                "operator",  # records' fields are plain functions: `operator` is ~0.4 ms of a cold start
                "os", "posixpath", "_collections_abc",  # ~0.9 ms: posix's calls and hook/purepath.py instead
                "itertools")  # core/atomicfile.py's temp names count with a range's iterator


def _container(tmp_path: Path) -> tuple[Path, Path]:
    rootfs = tmp_path / "bundle" / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    libdir = rootfs / LIBDIR.lstrip("/")
    libdir.mkdir(parents=True)
    libz = os.path.realpath(f"{LIBDIR}/libz.so.1")
    shutil.copy(libz, libdir / os.path.basename(libz))
    (rootfs.parent / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "linux": {
        "devices": [{"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3}]}}))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                                 "bundle": str(rootfs.parent)}))
    return state, rootfs


def _run_as_the_spec_names_it(args: list[str], stdin: Path | None, *extra: str) -> subprocess.CompletedProcess[str]:
    path, argv, _ = hook_command(None)
    with open(stdin or os.devnull, "rb") as source:
        return subprocess.run([path, *extra, *argv[1:], "cdi-hook", *args], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin"}, stdin=source, cwd="/", timeout=60)


def test_one_process_makes_the_links_and_the_linker_cache_importing_only_what_it_needs(tmp_path: Path) -> None:
    state, rootfs = _container(tmp_path)
    real = os.path.basename(os.path.realpath(f"{LIBDIR}/libz.so.1"))
    done = _run_as_the_spec_names_it(["links-and-ldcache", "--link", f"{real}::{LIBDIR}/libz.so.1",
                                      "--folder", LIBDIR, "--application-profile", "/dev/nvidia3",
                                      "--server", str(tmp_path / "nobody-listens.sock")],
                                     state, "-X", "importtime")
    assert done.returncode == 0, done.stderr
    assert os.readlink(rootfs / LIBDIR.lstrip("/") / "libz.so.1") == real
    assert b"EGLVisibleDGPUDevices\",0x8]" in (rootfs / APPLICATION_PROFILE.lstrip("/")).read_bytes()
    entries = {e.soname: e.path for e in parse_ldcache((rootfs / "etc/ld.so.cache").read_bytes())}
    assert entries == {"libz.so.1": f"{LIBDIR}/libz.so.1"}  # the link made first, then the cache read it
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line} - {"package"}
    assert {m for m in imported if m.split(".")[0] == "devinject"} == CDI_HOOK_MODULES
    assert not [m for m in imported if m.split(".")[0] in NOT_IMPORTED], sorted(imported)


def test_a_cdi_hook_with_nothing_to_make_returns_before_reading_its_state(tmp_path: Path) -> None:
    for args in (["links-and-ldcache"], ["create-symlinks"], ["update-ldcache", "--forward-compat", "/c:libx.so:1"],
                 ["update-application-profile"]):
        done = _run_as_the_spec_names_it(args, None, "-X", "importtime")  # no state on stdin: not read
        assert (done.returncode, [line for line in done.stderr.splitlines() if "import time" not in line]) == (0, [])
        assert "devinject.hook.executor" not in done.stderr
        assert "devinject.hook.client" not in done.stderr  # nothing to hand a hook server either
    bad = _run_as_the_spec_names_it(["links-and-ldcache", "--link", "bad"], None)
    assert bad.returncode == 1 and "is not TARGET::/ABSOLUTE/LINK" in bad.stderr  # checked before returning


def test_only_a_cdi_hook_with_something_to_make_is_offered_to_a_hook_server() -> None:
    assert worth_serving(["hook", "--spec-dir", "/x"])
    assert worth_serving(["cdi-hook", "links-and-ldcache", "--link", "a::/b"])
    assert worth_serving(["cdi-hook", "update-ldcache", "--folder=/usr/lib"])
    assert worth_serving(["cdi-hook", "update-application-profile", "--application-profile", "/dev/nvidia0"])
    assert not worth_serving(["cdi-hook", "links-and-ldcache"])  # nothing to make: returns at once, here
    assert not worth_serving(["cdi-hook", "update-ldcache", "--forward-compat", "/c:libx.so:1"])
    assert not worth_serving(["cdi-hook", "links-and-ldcache", "--link", "a::/b", "--help"])  # printed here
    assert not worth_serving(["generate"]) and not worth_serving([])
