"""devinject's application profile against NVIDIA's own hook: the real `nvidia-cdi-hook update-application-profile`
(NVIDIA Container Toolkit 1.20.0, ../shared/peers) and devinject's cdi-hook, as a spec names it, run on two copies
of one container (its /dev made with mknod, as a runtime makes it, and config.json's linux.devices saying the
same): the same file, bytes and modes, the same directories, for the same GPUs. Where they differ on purpose
(docs/driver-fidelity.md): an image's absolute /etc/nvidia link, which NVIDIA's refuses (the container does
not start) and devinject follows inside the rootfs."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import stat
import subprocess
from pathlib import Path

import pytest

from devinject.hook.plan import APPLICATION_PROFILE, application_profile
from devinject.specs.generate import hook_command
from tests.e2e.conftest import require
from tests.e2e.peers import PEERS

pytestmark = pytest.mark.live

PROFILE = APPLICATION_PROFILE.lstrip("/")


@pytest.fixture(scope="module")
def nvidia_cdi_hook(live_root: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """NVIDIA's nvidia-cdi-hook 1.20.0, unpacked and checked against the peers' SHA256SUMS."""
    packed = PEERS / "nvidia-cdi-hook.xz"
    require(packed.exists(), f"{packed} missing (../shared/peers: NVIDIA Container Toolkit 1.20.0)")
    binary = tmp_path_factory.mktemp("peers") / "nvidia-cdi-hook"
    binary.write_bytes(lzma.decompress(packed.read_bytes()))
    binary.chmod(0o755)
    sums = dict(reversed(line.split()) for line in (PEERS / "SHA256SUMS").read_text().splitlines() if line.strip())
    assert hashlib.sha256(binary.read_bytes()).hexdigest() == sums["nvidia-cdi-hook"]
    return binary


def _container(base: Path, minors: list[int], *, etc_nvidia_link: str | None = None) -> tuple[Path, bytes]:
    """A bundle whose rootfs /dev has a char node /dev/nvidia<minor> per GPU (and nvidiactl, never a GPU), as
    the runtime made them, and whose config.json lists the same; its OCI state."""
    rootfs = base / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    if etc_nvidia_link:
        (rootfs / "etc/nvidia").symlink_to(etc_nvidia_link)
    nodes = {f"/dev/nvidia{m}": m for m in minors} | {"/dev/nvidiactl": 255}
    for path, minor in nodes.items():
        os.mknod(rootfs / path.lstrip("/"), 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    config = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "linux": {"devices": [
        {"path": path, "type": "c", "major": 195, "minor": minor} for path, minor in nodes.items()]}}
    (base / "config.json").write_text(json.dumps(config))
    state = {"ociVersion": "1.0.2", "id": base.name, "status": "creating", "pid": os.getpid(), "bundle": str(base)}
    return rootfs, json.dumps(state).encode()


def _devinject(state: bytes, gpus: list[str]) -> subprocess.CompletedProcess[bytes]:
    path, argv, env = hook_command(None)  # as generate names the spec's hook by default
    flags = [arg for gpu in gpus for arg in ("--application-profile", gpu)]
    return subprocess.run([path, *argv[1:], "cdi-hook", "update-application-profile", *flags, "--no-server"],
                          input=state, capture_output=True, env=dict(e.split("=", 1) for e in env), timeout=60)


def _written(rootfs: Path) -> list[tuple[str, int, bytes]]:
    """Everything under the rootfs's /etc/nvidia: path, mode, contents (files)."""
    top = rootfs / "etc/nvidia"
    if not top.exists():
        return []
    found = [top, *sorted(top.rglob("*"))]
    return [(str(p.relative_to(rootfs)), stat.S_IMODE(p.lstat().st_mode), p.read_bytes() if p.is_file() else b"")
            for p in found]


@pytest.mark.parametrize("minors", [[0, 3], [1], [7, 63], [0, 64], []], ids=["gpus-0-3", "gpu-1", "gpus-7-63",
                                                                           "minor-64-dropped", "no-gpu"])
def test_the_same_file_as_nvidias_hook_for_the_same_gpus(nvidia_cdi_hook: Path, tmp_path: Path,
                                                         minors: list[int]) -> None:
    theirs, their_state = _container(tmp_path / "nvidia", minors)
    ours, our_state = _container(tmp_path / "devinject", minors)
    done = subprocess.run([str(nvidia_cdi_hook), "update-application-profile"], input=their_state,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # the spec names every GPU of the node; the container's own are those its runtime gave it
    mine = _devinject(our_state, [f"/dev/nvidia{m}" for m in range(66)])
    assert mine.returncode == 0, mine.stderr
    assert _written(ours) == _written(theirs)
    expected = tuple(m for m in minors if m < 64)
    if expected:
        assert (ours / PROFILE).read_bytes() == application_profile(expected)
    else:
        assert _written(ours) == []  # no GPU of the spec's in the container: no file, as NVIDIA's


def test_an_image_s_absolute_etc_nvidia_link_stays_in_the_rootfs(nvidia_cdi_hook: Path, tmp_path: Path) -> None:
    """NVIDIA's hook refuses the link (`path escapes from parent`: the container does not start); devinject's
    follows it inside the rootfs, as the container will see it, and writes nothing outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    theirs, their_state = _container(tmp_path / "nvidia", [0], etc_nvidia_link=str(outside))
    ours, our_state = _container(tmp_path / "devinject", [0], etc_nvidia_link=str(outside))
    refused = subprocess.run([str(nvidia_cdi_hook), "update-application-profile"], input=their_state,
                             capture_output=True, timeout=60)
    assert refused.returncode != 0 and b"path escapes from parent" in refused.stderr
    assert _devinject(our_state, ["/dev/nvidia0"]).returncode == 0
    assert os.listdir(outside) == []
    inside = ours / str(outside).lstrip("/") / "nvidia-application-profiles-rc.d" / "10-container.conf"
    assert inside.read_bytes() == application_profile((0,))
