#!/usr/bin/env python3
"""devinject on a real NVIDIA GPU, in a few minutes: `list`, `generate`, `doctor`, NVML's facts held to `nvidia-smi`,
and a container given GPU 0 by devinject alone (runc and devinject's OCI hook) that runs `nvidia-smi -L` and, where
nvcc is installed, a small CUDA program. Run as root from the project root: `tools/gpu_check.sh` (docs/testing.md,
"On a real GPU"). Every step prints one PASS, FAIL or SKIP line with its reason; the exit status is 1 when one failed.

The container's image is made here, never pulled (the GPU machines reach nothing outside): busybox for the shell
where it is installed, and the C library that nvidia-smi and the CUDA program link besides the driver's own, copied
from the host; the driver's files (nvidia-smi, libnvidia-ml, libcuda) and the device nodes come from devinject's
spec only, so a container that lists its GPU proves the injection."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parent.parent
DEVINJECT = [sys.executable, "-m", "devinject"]  # this interpreter: the wrapper picks one with the dependencies
STEP_TIMEOUT = 120
CUDA_PROGRAM = r"""
#include <cstdio>
__global__ void add(int *x) { x[threadIdx.x] += threadIdx.x; }
int main() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) { printf("no CUDA device\n"); return 1; }
    int *x; cudaMallocManaged(&x, 32 * sizeof(int));
    for (int i = 0; i < 32; i++) x[i] = 1;
    add<<<1, 32>>>(x);
    if (cudaDeviceSynchronize() != cudaSuccess) { printf("kernel failed\n"); return 1; }
    int sum = 0; for (int i = 0; i < 32; i++) sum += x[i];
    printf("devices %d sum %d\n", count, sum);
    return sum == 32 + 496 ? 0 : 1;
}
"""

failures: list[str] = []


def say(verdict: str, step: str, detail: str = "") -> None:
    print(f"{verdict:4} {step}{': ' + detail if detail else ''}", flush=True)
    if verdict == "FAIL":
        failures.append(step)


def run(command: list[str], timeout: float = STEP_TIMEOUT, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", f"timed out after {timeout:.0f} s")
    except OSError as error:
        return subprocess.CompletedProcess(command, 127, "", str(error))


def devinject(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(PROJECT / "src"))
    return run([*DEVINJECT, *args], env=env)


def smi_facts(nvidia_smi: str) -> list[dict[str, str]]:
    """nvidia-smi's answer per GPU, the reference NVML's facts through devinject are held to."""
    fields = "index,pci.bus_id,uuid,name,memory.total,compute_cap,driver_version"
    done = run([nvidia_smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    if done.returncode != 0:
        return []
    keys = fields.split(",")
    return [dict(zip(keys, (cell.strip() for cell in line.split(",")), strict=False))
            for line in done.stdout.splitlines() if line.strip()]


def check_list(smi: list[dict[str, str]], host: list[str]) -> list[dict[str, Any]]:
    table = devinject("list", *host)
    print(table.stdout.rstrip())
    say("PASS" if table.returncode == 0 else "FAIL", "devinject list", table.stderr.strip()[-300:])
    listed = devinject("list", *host, "--json", "--kind", "nvidia.com/gpu")
    try:
        gpus: list[dict[str, Any]] = json.loads(listed.stdout)
    except json.JSONDecodeError:
        say("FAIL", "devinject list --json", listed.stderr.strip()[-300:])
        return []
    by_address = {g["pci_address"].lower(): g for g in gpus}
    for gpu in smi:
        address = gpu["pci.bus_id"].lower()[-12:]  # nvidia-smi says 00000000:2A:00.0
        mine = by_address.get(address)
        if mine is None:
            say("FAIL", f"GPU {gpu['index']} ({address})", "nvidia-smi lists it, devinject does not")
            continue
        memory_mib = (mine.get("memory_bytes") or 0) // (1 << 20)
        problems = [f"{what}: devinject {ours!r}, nvidia-smi {theirs!r}" for what, ours, theirs in (
            ("uuid", mine.get("uuid"), gpu["uuid"]),
            ("memory MiB", memory_mib, int(float(gpu["memory.total"] or 0))),
            ("compute capability", mine.get("compute_capability"), gpu["compute_cap"]),
        ) if ours != theirs]
        say("FAIL" if problems else "PASS", f"NVML facts of GPU {gpu['index']} ({gpu['name']})",
            "; ".join(problems) or f"{memory_mib} MiB, CC {mine.get('compute_capability')}, {mine.get('uuid')}")
    if len(gpus) != len(smi):
        say("FAIL", "GPU count", f"devinject {len(gpus)}, nvidia-smi {len(smi)}")
    return gpus


def container_libraries(binary: str) -> list[str]:
    """The host libraries `binary` links that are not the driver's (the driver's come from the spec)."""
    done = run(["ldd", binary])
    found = []
    for line in done.stdout.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/") and "nvidia" not in path and "libcuda" not in path:
            found.append(path)
    return found


def make_bundle(work: Path, spec_dir: Path, command: list[str], extra: list[str]) -> Path:
    bundle = work / f"bundle-{uuid.uuid4().hex[:6]}"
    rootfs = bundle / "rootfs"
    for directory in ("bin", "proc", "sys", "dev", "tmp", "etc", "usr/bin"):
        (rootfs / directory).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox")
    if busybox:
        shutil.copy(busybox, rootfs / "bin/busybox")
        (rootfs / "bin/sh").symlink_to("busybox")
    for path in extra:  # the C library and its loader, at the paths the binaries ask for them
        target = rootfs / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.realpath(path), target)
    run(["runc", "spec"], cwd=bundle)
    config = json.loads((bundle / "config.json").read_text())
    config["process"].update(terminal=False, args=command, env=["PATH=/usr/bin:/bin"])
    config["root"]["readonly"] = False
    config["annotations"] = {"cdi.k8s.io/gpucheck": "nvidia.com/gpu=0"}
    hook_args = ["--spec-dir", str(spec_dir), "--state-dir", str(work / "state"), "--log-file",
                 str(work / "hook.log"), "--no-server"]
    config["hooks"] = {"prestart": [{"path": sys.executable, "args": [
        sys.executable, "-m", "devinject", "hook", *hook_args], "env": [f"PYTHONPATH={PROJECT / 'src'}",
                                                                        "PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
        "timeout": 30}]}
    (bundle / "config.json").write_text(json.dumps(config, indent=1))
    return bundle


def run_in_container(work: Path, spec_dir: Path, step: str, command: list[str], extra: list[str],
                     expect: str) -> None:
    bundle = make_bundle(work, spec_dir, command, extra)
    name = f"gpucheck-{uuid.uuid4().hex[:8]}"
    done = run(["runc", "run", name], cwd=bundle, stdin=subprocess.DEVNULL)
    run(["runc", "delete", "-f", name])
    out = (done.stdout + done.stderr).strip()
    say("PASS" if done.returncode == 0 and expect in out else "FAIL", step, out[-600:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/", help="the host's / (a fixture host in devinject's own test of this "
                        "script: the container step runs on the real / only)")
    parser.add_argument("--nvidia-smi", default=shutil.which("nvidia-smi") or "nvidia-smi")
    options = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("tools/gpu_check.py: run as root (the container step mknods and mounts)", file=sys.stderr)
        return 2
    smi = smi_facts(options.nvidia_smi)
    if not smi:
        print("tools/gpu_check.py: nvidia-smi lists no GPU here: run it on a machine with an NVIDIA GPU and driver",
              file=sys.stderr)
        return 2
    say("PASS", "nvidia-smi", f"{len(smi)} GPU(s), driver {smi[0]['driver_version']}")
    host = ["--root", options.root, "--nvml"]
    check_list(smi, host)
    with tempfile.TemporaryDirectory(prefix="devinject-gpucheck-") as temp:
        work = Path(temp)
        spec_dir = work / "cdi"
        spec_dir.mkdir()
        made = devinject("generate", *host, "--output-dir", str(spec_dir))
        specs = sorted(p.name for p in spec_dir.iterdir())
        say("PASS" if made.returncode == 0 and specs else "FAIL", "devinject generate",
            ", ".join(specs) or made.stderr.strip()[-300:])
        valid = devinject("validate", str(spec_dir))
        say("PASS" if valid.returncode == 0 else "FAIL", "devinject validate", valid.stdout.strip()[-300:])
        doctor = devinject("doctor", "--root", options.root, "--spec-dir", str(spec_dir), "nvidia.com/gpu=0")
        print(doctor.stdout.rstrip())
        # the runtime link fails on a machine with no CDI runtime configured, which is not devinject's fault
        say("PASS" if doctor.returncode in (0, 1) and "pci" in doctor.stdout else "FAIL", "devinject doctor",
            f"exit {doctor.returncode}")
        if options.root != "/" or not shutil.which("runc"):
            say("SKIP", "container with GPU 0", "not the host's own /" if options.root != "/" else "no runc here")
            return 1 if failures else 0
        smi_binary = options.nvidia_smi
        shell = ["/bin/sh", "-c"] if shutil.which("busybox") else []
        listing = [*shell, "nvidia-smi -L; ls /dev/nvidia*"] if shell else ["/usr/bin/nvidia-smi", "-L"]
        run_in_container(work, spec_dir, "container given GPU 0 by devinject's spec runs nvidia-smi -L", listing,
                         container_libraries(smi_binary), "GPU 0:")
        nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc")
                                        else None)
        if nvcc is None:
            say("SKIP", "CUDA program in the container", "nvcc is not installed here")
        else:
            source = work / "add.cu"
            source.write_text(CUDA_PROGRAM)
            built = run([nvcc, "-cudart", "static", "-o", str(work / "add"), str(source)], timeout=300)
            if built.returncode != 0:
                say("FAIL", "nvcc", built.stderr.strip()[-300:])
            else:
                program = str(work / "add")
                extra = [*container_libraries(program), program]
                run_in_container(work, spec_dir, "CUDA program in the container", [program], extra, "sum 528")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
