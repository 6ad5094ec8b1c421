"""Real podman: CDI specs written by `devinject generate`, and the hooks.d file running `devinject hook`."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.hooksd import hooks_d_entry
from tests.e2e.conftest import DEVINJECT, IMAGE, make_rootfs, require

pytestmark = pytest.mark.live
PODMAN = ["podman", "run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
          "nproc=1024:1024", "--network", "none"]
CDI_DIR = Path("/var/run/cdi")


@pytest.fixture(scope="session")
def image(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    require(shutil.which("podman") is not None, "podman not installed (make system-deps)")
    rootfs = make_rootfs(tmp_path_factory.mktemp("image") / "rootfs")
    tarball = rootfs.parent / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
    subprocess.run(["podman", "import", "-q", str(tarball), IMAGE], check=True, capture_output=True)
    return IMAGE


@pytest.fixture
def cdi_spec(spec_dir: Path) -> Iterator[Path]:
    """Put the generated nvidia.com/gpu spec where podman 4 looks (it has no spec-dir flag)."""
    CDI_DIR.mkdir(parents=True, exist_ok=True)
    target = CDI_DIR / "nvidia.com-gpu.yaml"
    backup = target.read_bytes() if target.exists() else None
    shutil.copy(spec_dir / "nvidia.com-gpu.yaml", target)
    yield target
    if backup is None:
        target.unlink()
    else:
        target.write_bytes(backup)


def test_podman_consumes_generated_cdi_spec(image: str, cdi_spec: Path) -> None:
    script = ("stat -c '%t:%T' /dev/nvidia0; grep libcuda /proc/mounts; "
              "readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1; cat /dev/nvidia0; echo done")
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=0", image, "sh", "-c", script], capture_output=True,
                          text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "c3:0" in out  # 195:0 in hex, as stat prints it
    (mount,) = [line for line in out.splitlines() if "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14 " in line]
    assert mount.split()[3].startswith("ro,nosuid,nodev")  # read-only driver file
    assert "libcuda.so.550.54.14\n" in out  # the SONAME link made by devinject's CDI createContainer hook
    assert "No such device or address" in out


def test_podman_with_hooks_d_file_runs_devinject_hook(image: str, spec_dir: Path, tmp_path: Path) -> None:
    hooks_dir = tmp_path / "hooks.d"
    hooks_dir.mkdir()
    entry = hooks_d_entry(DEVINJECT)
    entry["hook"]["args"] += ["--spec-dir", str(spec_dir), "--state-dir", str(tmp_path / "state"),
                              "--log-file", str(tmp_path / "hook.log")]
    (hooks_dir / "10-devinject.json").write_text(json.dumps(entry))
    done = subprocess.run([*PODMAN, "--hooks-dir", str(hooks_dir), "--annotation", "cdi.k8s.io/test=nvidia.com/gpu=0",
                           image, "sh", "-c", "stat -c '%t:%T' /dev/nvidia0; cat /dev/nvidia0; echo done"],
                          capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "c3:0" in out, out
    assert "No such device or address" in out
    records = [json.loads(line) for line in (tmp_path / "hook.log").read_text().splitlines()]
    assert any(r.get("result") == "ok" for r in records)
    without = subprocess.run([*PODMAN, "--hooks-dir", str(hooks_dir), image, "sh", "-c", "ls /dev/nvidia0 || echo no"],
                             capture_output=True, text=True, timeout=180)
    assert "no" in without.stdout  # the `when` condition keeps the hook off unannotated containers
