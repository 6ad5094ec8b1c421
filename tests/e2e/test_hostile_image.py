"""Hostile images against the real runtimes: no link in an image may make devinject write on the host.

Before `pivot_root` the container's `/proc` is already mounted inside the rootfs, and its pid 1 still sees
the host's root: `<rootfs>/proc/1/root` is the host's `/`. An image whose `/etc` or library directory is a
link to `/proc/1/root/<host dir>` used to get `ld.so.cache` and SONAME links written into that host dir
by the host's `ldconfig -r`, which follows such links itself.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.linux.ldcache import parse_ldcache
from tests.e2e.conftest import PODMAN, Bundle, container_name, make_rootfs, require

pytestmark = pytest.mark.live
LIBDIR = "usr/lib/x86_64-linux-gnu"


def hostile(rootfs: Path, variant: str, canary: Path) -> None:
    """Point the image's /etc or its library directory at the canary through the container's /proc.

    The image also ships `proc/1/root/<canary>` as plain directories, so that tools resolving the link
    before the container's /proc is mounted over them (podman) find an ordinary directory and go on."""
    via_proc = f"/proc/1/root{canary}"
    (rootfs / via_proc.lstrip("/")).mkdir(parents=True)
    if variant == "etc":
        shutil.rmtree(rootfs / "etc")
        (rootfs / "etc").symlink_to(via_proc)
    else:
        (rootfs / LIBDIR).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / LIBDIR).symlink_to(via_proc)


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    """A host library directory an attacker would like to write into: one real library whose SONAME link
    is missing (ldconfig would add it). It must stay exactly as it is."""
    require(shutil.which("gcc") is not None, "gcc not installed (make system-deps)")
    path = Path("/tmp") / f"devinject-canary-{tmp_path.name}"
    path.mkdir()
    (tmp_path / "host.c").write_text("int host_lib(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libhost.so.1", "-o", str(path / "libhost.so.1.0"),
                    str(tmp_path / "host.c")], check=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def untouched(canary: Path) -> bool:
    return sorted(p.name for p in canary.iterdir()) == ["libhost.so.1.0"]


@pytest.mark.parametrize("v2", [False, True], ids=["cgroup-v1", "cgroup-v2-ebpf"])
@pytest.mark.parametrize("variant", ["etc", "libdir"])
def test_runc_hook_never_writes_through_proc_1_root(bundle: Bundle, canary: Path, variant: str, v2: bool) -> None:
    hostile(bundle.rootfs, variant, canary)
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    done = bundle.run(container_name(), v2=v2)
    assert untouched(canary), done.stderr  # nothing written on the host
    assert done.returncode == 0, done.stderr  # and the container still starts, its edits kept in-root


@pytest.fixture
def hostile_image(live_root: None, tmp_path: Path, request: pytest.FixtureRequest, canary: Path) -> Iterator[str]:
    require(shutil.which("podman") is not None, "podman not installed (make system-deps)")
    rootfs = make_rootfs(tmp_path / "rootfs")
    hostile(rootfs, request.param, canary)
    tarball = tmp_path / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    name = f"localhost/devinject-hostile-{request.param}:test"
    subprocess.run(["podman", "import", "-q", str(tarball), name], check=True, capture_output=True)
    yield name
    subprocess.run(["podman", "rmi", "-f", name], capture_output=True)


@pytest.mark.parametrize("hostile_image", ["etc", "libdir"], indirect=True)
def test_podman_cdi_hook_never_writes_through_proc_1_root(hostile_image: str, cdi_spec: Path, canary: Path) -> None:
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=0", hostile_image,
                           "true"], capture_output=True, text=True, timeout=180)
    assert untouched(canary), done.stderr
    assert done.returncode == 0, done.stderr


def test_honest_image_gets_a_cache_its_loader_uses(bundle: Bundle, tmp_path: Path, live_host: Path) -> None:
    """The cache devinject writes is read by the image's real glibc loader: a program linked against the
    injected library (in a directory outside the default search path) runs."""
    require(shutil.which("gcc") is not None, "gcc not installed (make system-deps)")
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (tmp_path / "v.c").write_text("int vendor_answer(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libvendor.so.1", "-o", str(vendor / "libvendor.so.1.2.3"),
                    str(tmp_path / "v.c")], check=True)
    (tmp_path / "m.c").write_text('#include <stdio.h>\nint vendor_answer(void);\n'
                                  'int main(void) { printf("answer %d\\n", vendor_answer()); return 0; }\n')
    (vendor / "libvendor.so").symlink_to("libvendor.so.1.2.3")
    subprocess.run(["gcc", "-o", str(bundle.rootfs / "bin" / "answer"), str(tmp_path / "m.c"), f"-L{vendor}",
                    "-lvendor"], check=True)
    (vendor / "libvendor.so").unlink()
    copy_glibc(bundle.rootfs)
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    (spec_dir / "vendor.yaml").write_text(
        "cdiVersion: 0.5.0\nkind: example.com/lib\ndevices:\n- name: a\n  containerEdits:\n"
        "    deviceNodes: [{path: /dev/example0, type: c, major: 1, minor: 3}]\ncontainerEdits:\n  mounts:\n"
        f"  - {{hostPath: {vendor}/libvendor.so.1.2.3, containerPath: /opt/vendor/lib/libvendor.so.1.2.3, "
        "options: [ro, nosuid, nodev, bind]}\n  hooks:\n"
        f"  - {{hookName: createContainer, path: /usr/bin/devinject, args: [devinject, cdi-hook, create-symlinks, "
        "--link, 'libvendor.so.1.2.3::/opt/vendor/lib/libvendor.so.1']}\n"
        f"  - {{hookName: createContainer, path: /usr/bin/devinject, args: [devinject, cdi-hook, update-ldcache, "
        "--folder, /opt/vendor/lib]}\n")
    bundle.use_spec_dir(spec_dir)
    bundle.save(["/bin/answer"], annotations={"cdi.k8s.io/test": "example.com/lib=a"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "answer 42"
    cache = parse_ldcache((bundle.rootfs / "etc" / "ld.so.cache").read_bytes())
    assert ("libvendor.so.1", "/opt/vendor/lib/libvendor.so.1") in [(e.soname, e.path) for e in cache]
    assert ("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6") in [(e.soname, e.path) for e in cache]  # image's kept


def copy_glibc(rootfs: Path) -> None:
    """The host's loader and libc in the image, with the image's own ld.so.cache made by ldconfig."""
    for source in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):
        target = rootfs / source.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(source).resolve(), target)
    (rootfs / "etc" / "ld.so.conf").write_text("/lib/x86_64-linux-gnu\n")
    subprocess.run(["ldconfig", "-r", str(rootfs)], check=True)
