"""tools/gpu_check.py, the script a session with a real GPU runs, held to a fixture host through the NVML stub and a
stand-in nvidia-smi: facts that agree pass, a wrong one fails with both values and exit 1 (so a GPU run that says
PASS means the facts agreed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nvmlstub import host_gpus

PROJECT = Path(__file__).resolve().parents[2]
H100_MIB = 81559

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the script runs as root")


def fake_nvidia_smi(tmp_path: Path, root: Path, memory_mib: int) -> Path:
    rows = [f"{i}, 00000000:{gpu.bus_id[5:].upper()}, {gpu.uuid}, {gpu.model}, {memory_mib}, 9.0, 550.54.14"
            for i, gpu in enumerate(host_gpus(root))]
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\ncat <<'END'\n" + "\n".join(rows) + "\nEND\n")
    script.chmod(0o755)
    return script


def gpu_check(root: Path, smi: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PROJECT / "tools/gpu_check.py"), "--root", str(root),
                           "--nvidia-smi", str(smi)], capture_output=True, text=True, timeout=300)


def test_facts_that_agree_with_nvidia_smi_pass(nvml_host, tmp_path):
    root = nvml_host("hgx-h100")
    done = gpu_check(root, fake_nvidia_smi(tmp_path, root, H100_MIB))
    facts = [line for line in done.stdout.splitlines() if "NVML facts" in line]
    assert len(facts) == 8 and all(line.startswith("PASS") for line in facts), done.stdout + done.stderr
    assert "PASS devinject generate" in done.stdout and "PASS devinject validate" in done.stdout, done.stdout
    assert "SKIP container with GPU 0: not the host's own /" in done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_fact_that_disagrees_fails_naming_both_values(nvml_host, tmp_path):
    root = nvml_host("hgx-h100")
    done = gpu_check(root, fake_nvidia_smi(tmp_path, root, 40960))
    assert done.returncode == 1
    assert f"memory MiB: devinject {H100_MIB}, nvidia-smi 40960" in done.stdout, done.stdout
