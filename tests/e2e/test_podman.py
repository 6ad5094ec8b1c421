"""Real podman: CDI specs written by `devinject generate`, and the hooks.d file running `devinject hook`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from devinject.install.hooksd import hook_command, hooks_d_entry
from tests.e2e.conftest import DEVINJECT, PODMAN, in_cdi_dir
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_mi300x

pytestmark = pytest.mark.live


def test_podman_consumes_generated_cdi_spec(image: str, cdi_spec: Path) -> None:
    script = ("stat -c '%t:%T' /dev/nvidia0; grep libcuda /proc/mounts; "
              "readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1; cat /dev/nvidia0; "
              "readlink /dev/dri/by-path/pci-0000:01:00.0-render; echo done")
    done = subprocess.run([*PODMAN, "--device", "nvidia.com/gpu=0", image, "sh", "-c", script], capture_output=True,
                          text=True, timeout=180)
    out = done.stdout + done.stderr
    assert "c3:0" in out  # 195:0 in hex, as stat prints it
    (mount,) = [line for line in out.splitlines() if "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14 " in line]
    assert mount.split()[3].startswith("ro,nosuid,nodev")  # read-only driver file
    assert "libcuda.so.550.54.14\n" in out  # the SONAME link made by devinject's CDI createContainer hook
    assert "No such device or address" in out
    assert "\n../renderD129\n" in out  # the GPU's DRM by-path link, made by the spec's one hook


def test_podman_gives_a_container_the_by_path_links_of_its_own_gpus_only(image: str, tmp_path: Path) -> None:
    """Eight MI300X GPUs, their DRM by-path links all named in the spec's one hook (`--device-link`): a container
    given GPUs 1 and 3 gets exactly their four links, each to a node it has, none naming another GPU's address."""
    host = tmp_path / "host"
    builder = LibBuilder()
    try:
        build_mi300x(builder, FakeHost(host, real_nodes=True))
    finally:
        shutil.rmtree(builder.tmp, ignore_errors=True)
    subprocess.run([DEVINJECT, "generate", "--root", str(host), "--output-dir", str(tmp_path / "cdi"),
                    "--kind", "amd.com/gpu", "--hook-path", DEVINJECT], check=True, capture_output=True, timeout=120)
    script = "for l in /dev/dri/by-path/*; do echo $l; test -c $l && echo node; done; echo done"
    with in_cdi_dir(tmp_path / "cdi" / "amd.com-gpu.yaml"):
        done = subprocess.run([*PODMAN, "--device", "amd.com/gpu=1", "--device", "amd.com/gpu=3", image,
                               "sh", "-c", script], capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.endswith("done\n"), out
    links = [line for line in out.splitlines() if line.startswith("/dev/")]
    expected = [f"/dev/dri/by-path/pci-0000:{bus}:00.0-{kind}" for bus in ("1d", "65") for kind in ("card", "render")]
    assert links == expected
    assert out.count("node\n") == 4  # each link resolves to a device node the container was given


@pytest.mark.parametrize("executable", [None, DEVINJECT], ids=["launcher", "console-script"])
def test_podman_with_hooks_d_file_runs_devinject_hook(image: str, spec_dir: Path, tmp_path: Path,
                                                      executable: str | None) -> None:
    hooks_dir = tmp_path / "hooks.d"
    hooks_dir.mkdir()
    entry = hooks_d_entry(hook_command(executable))
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


@pytest.mark.parametrize(("value", "fires"), [("nvidia.com/gpu=0", True), ("", False), (" ", False), ("\t", False)])
def test_hooks_d_filter_fires_only_on_an_annotation_that_names_something(image: str, tmp_path: Path, value: str,
                                                                         fires: bool) -> None:
    """The shipped `when` clause, evaluated by podman itself, with a marker hook in devinject's place."""
    marker = tmp_path / "fired"
    script = tmp_path / "marker.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    hooks_dir = tmp_path / "hooks.d"
    hooks_dir.mkdir()
    entry = hooks_d_entry(hook_command(str(script)))
    entry["hook"]["args"] = ["marker.sh"]
    (hooks_dir / "10-devinject.json").write_text(json.dumps(entry))
    done = subprocess.run([*PODMAN, "--hooks-dir", str(hooks_dir), "--annotation", f"cdi.k8s.io/test={value}",
                           image, "true"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert marker.exists() == fires
