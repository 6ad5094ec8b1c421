"""The device plugin's two delivery paths compose: its Allocate answer mounts the SONAME links as files (for
runtimes without CDI), and on a runtime that applies CDI the spec's create-symlinks hook then meets a mount
point where it would make the link. It used to fail the container (`Device or resource busy`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import in_private_mount_ns

pytestmark = pytest.mark.live

LINK_OVER_MOUNT = r"""
import json, os, sys
from devinject.linux import syscalls
from devinject.hook.executor import Executor
from devinject.hook.plan import Plan, Symlink

rootfs, what = sys.argv[1], sys.argv[2]
lib = os.path.join(rootfs, "usr/lib")
host_lib = os.path.join(os.path.dirname(rootfs), "libcuda.so.550.54.14")
# as the runtime applies the Allocate answer: the library, and the same file at its SONAME path
for name in ("libcuda.so.550.54.14", "libcuda.so.1"):
    open(os.path.join(lib, name), "w").close()
source = host_lib if what == "same" else os.path.join(os.path.dirname(rootfs), "other.so")
syscalls.mount(host_lib, os.path.join(lib, "libcuda.so.550.54.14"), syscalls.MS_BIND)
syscalls.mount(source, os.path.join(lib, "libcuda.so.1"), syscalls.MS_BIND)
try:
    log = Executor(rootfs).apply(Plan(links=(Symlink("libcuda.so.550.54.14", "/usr/lib/libcuda.so.1"),)))
    print(json.dumps({"ok": True, "log": log}))
except Exception as err:
    print(json.dumps({"ok": False, "error": str(err)}))
assert sorted(os.listdir(lib)) == ["libcuda.so.1", "libcuda.so.550.54.14"], os.listdir(lib)  # no temp link left
"""


def _run(tmp_path: Path, what: str) -> dict[str, object]:
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "libcuda.so.550.54.14").write_bytes(b"\x7fELF driver")
    (tmp_path / "other.so").write_bytes(b"\x7fELF other")
    done = in_private_mount_ns(LINK_OVER_MOUNT, str(rootfs), what)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_a_link_whose_target_is_mounted_at_its_path_is_left_as_it_is(tmp_path: Path) -> None:
    result = _run(tmp_path, "same")
    assert result["ok"], result
    assert any("its target is mounted there already" in line for line in result["log"])  # type: ignore[attr-defined]


def test_another_file_mounted_at_the_links_path_is_still_an_error(tmp_path: Path) -> None:
    result = _run(tmp_path, "other")
    assert result == {"ok": False, "error": "link /usr/lib/libcuda.so.1: another file is mounted there in the "
                                            "container"}
