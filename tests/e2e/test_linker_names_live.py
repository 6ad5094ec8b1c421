"""The CDI hook's linker cache in a RHEL-style image, on real runc: it lists every name the real `ldconfig`
lists for the files and links the spec puts in the container, the unversioned `libcuda.so` included, and the
image's own loader finds the driver through it by that name.

The image is laid out as RHEL's are: `/lib64 -> usr/lib64`, glibc in `/usr/lib64`, an `/etc/ld.so.conf` of
`include ld.so.conf.d/*.conf`, its own ld.so.cache. Its loader and libc are this machine's (Debian's), whose
built-in search dirs are the multiarch ones (RHEL's are `/lib64` and `/usr/lib64`), so `ld.so.conf.d` names
the lib64 dirs for Debian's ldconfig, and the host is the HGX H100 fixture with its driver in `/usr/lib64`
(as on a RHEL node): a dir the loader searches only through the cache, as a Debian host's
`/usr/lib/x86_64-linux-gnu` is for a RHEL image's loader. An unversioned `dlopen("libcuda.so")` then finds
the driver only when the cache lists that name (NVIDIA's update-ldcache, which runs ldconfig, lists it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.cdi.model import ContainerEdits
from devinject.cdi.spec import load_file
from devinject.hook.plan import parse_cdi_hook, parse_link
from tests.e2e.conftest import DEVINJECT, oci_edits
from tests.fixtures.build_hosts import LIBDIR, FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live
LIB64 = "/usr/lib64"
PROBE_NAMES = ("libcuda.so", "libnvidia-ml.so", "libcuda.so.1")
PROBE = r"""#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int failed = 0;
    for (int i = 1; i < argc; i++) {
        void *handle = dlopen(argv[i], RTLD_NOW);
        printf("%s: %s\n", argv[i], handle ? "loaded" : dlerror());
        failed |= handle == NULL;
    }
    return failed;
}
"""
LDCONFIG_ENV = {"PATH": "/usr/sbin:/sbin:/usr/bin:/bin"}


def rhel_host(root: Path) -> Path:
    """The HGX H100 fixture with its driver's files in /usr/lib64 and its ld.so.conf naming that dir."""
    builder = LibBuilder()
    try:
        build_hgx_h100(builder, FakeHost(root, real_nodes=True))
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    (root / LIB64.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.move(root / LIBDIR.lstrip("/"), root / LIB64.lstrip("/"))
    (root / "etc/ld.so.conf.d/x86_64-linux-gnu.conf").unlink()
    (root / "etc/ld.so.conf.d/lib64.conf").write_text(f"{LIB64}\n")
    (root / "etc/ld.so.cache").unlink()
    subprocess.run(["ldconfig", "-X", "-r", str(root)], check=True, env=LDCONFIG_ENV)
    return root


def rhel_image(path: Path, probe_source: Path) -> Path:
    """A RHEL-style rootfs: glibc in /usr/lib64 (/lib64 a link to it), the dlopen probe, its own cache."""
    lib64 = path / LIB64.lstrip("/")
    lib64.mkdir(parents=True)
    (path / "lib64").symlink_to("usr/lib64")
    for source in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):
        shutil.copy(Path(source).resolve(), lib64 / Path(source).name)
    for directory in ("proc", "sys", "dev", "tmp", "usr/bin", "etc/ld.so.conf.d"):
        (path / directory).mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-o", str(path / "usr/bin/probe"), str(probe_source)], check=True)
    (path / "etc/ld.so.conf").write_text("include ld.so.conf.d/*.conf\n")
    # RHEL's glibc has /lib64 and /usr/lib64 built in; here the real dir, the one the spec's files are in
    (path / "etc/ld.so.conf.d/lib64.conf").write_text(f"{LIB64}\n")
    subprocess.run(["ldconfig", "-r", str(path)], check=True, env=LDCONFIG_ENV)
    return path


def listed(rootfs: Path) -> list[str]:
    """The entries of the rootfs's /etc/ld.so.cache as the real `ldconfig -p` prints them."""
    done = subprocess.run(["ldconfig", "-r", str(rootfs), "-p"], check=True, capture_output=True, text=True,
                          env=LDCONFIG_ENV)
    return [line.strip() for line in done.stdout.splitlines() if "=>" in line]


def as_ldconfig_makes_it(image: Path, edits: ContainerEdits, out: Path) -> Path:
    """The image with the spec's files copied where it mounts them and its links made, its cache then
    written by the real ldconfig from the image's own ld.so.conf."""
    shutil.copytree(image, out, symlinks=True)
    for mount in edits.mounts:
        if Path(mount.host_path).is_file():
            target = out / mount.container_path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(mount.host_path, target)
    for hook in edits.hooks:
        _, values = parse_cdi_hook(list(hook.args[hook.args.index("cdi-hook") + 1:]))
        for link in (parse_link(value) for value in values["--link"]):
            where = out / link.link.lstrip("/")
            where.parent.mkdir(parents=True, exist_ok=True)
            where.symlink_to(link.target)
    subprocess.run(["ldconfig", "-X", "-r", str(out)], check=True, env=LDCONFIG_ENV)
    return out


class Started:
    def __init__(self, rootfs: Path, reference: Path, run: subprocess.CompletedProcess[str]) -> None:
        self.rootfs, self.reference, self.run = rootfs, reference, run


@pytest.fixture(scope="module")
def started(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """One GPU container of the RHEL-style image on runc, the spec's CDI edits in its config.json as a CDI
    runtime writes them (its createContainer hook the spec's devinject cdi-hook)."""
    work = tmp_path_factory.mktemp("linker-names")
    host = rhel_host(work / "host")
    spec_file = work / "nvidia.com-gpu.yaml"
    subprocess.run([DEVINJECT, "generate", "--root", str(host), "--kind", "nvidia.com/gpu", "--output",
                    str(spec_file), "--hook-path", DEVINJECT], check=True, capture_output=True, timeout=120)
    spec = load_file(spec_file)
    edits = spec.edits.merge(next(d for d in spec.devices if d.name == "0").edits)
    assert any(m.container_path.startswith(f"{LIB64}/libcuda.so.") for m in edits.mounts), edits.mounts
    (work / "probe.c").write_text(PROBE)
    image = rhel_image(work / "image", work / "probe.c")
    reference = as_ldconfig_makes_it(image, edits, work / "reference")
    bundle = work / "bundle"
    bundle.mkdir()
    shutil.copytree(image, bundle / "rootfs", symlinks=True)
    subprocess.run(["runc", "spec"], cwd=bundle, check=True)
    config = json.loads((bundle / "config.json").read_text())
    wanted = oci_edits(edits)
    config["process"].update(terminal=False, args=["/usr/bin/probe", *PROBE_NAMES])
    config["root"]["readonly"] = False
    config["mounts"] += wanted["mounts"]
    config["linux"]["devices"] = wanted["devices"]
    config["linux"]["resources"]["devices"] += wanted["rules"]
    config["hooks"] = {"createContainer": wanted["hooks"]}
    (bundle / "config.json").write_text(json.dumps(config))
    name = f"devinject-linker-names-{uuid.uuid4().hex[:8]}"
    try:
        run = subprocess.run(["runc", "run", name], cwd=bundle, capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
        yield Started(bundle / "rootfs", reference, run)
    finally:
        subprocess.run(["runc", "delete", "-f", name], capture_output=True)


def test_the_cache_lists_what_the_real_ldconfig_lists_for_the_specs_files(started: Started) -> None:
    assert started.run.returncode in (0, 1), started.run.stderr  # the container ran (the probe's answer below)
    ours, theirs = listed(started.rootfs), listed(started.reference)
    assert ours == theirs
    assert f"libcuda.so (libc6,x86-64) => {LIB64}/libcuda.so" in ours
    assert sum(f"=> {LIB64}/libnv" in line or f"=> {LIB64}/libcuda" in line for line in ours) == 24


def test_an_unversioned_dlopen_in_the_image_finds_the_driver(started: Started) -> None:
    assert started.run.returncode == 0, (started.run.stdout, started.run.stderr)
    assert started.run.stdout.splitlines() == [f"{name}: loaded" for name in PROBE_NAMES]
