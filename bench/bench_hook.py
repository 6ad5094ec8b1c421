#!/usr/bin/env python3
"""Benchmark `devinject hook`: `runc run` of a trivial container without the hook, and with it injecting
8 GPUs plus the driver libraries (nvidia.com/gpu=all on the HGX H100 host, real mknod nodes), with the
ledger off and on. Every container gets a fresh overlay rootfs, as a container runtime's snapshotter gives
runc: the hook creates its nodes, mount targets, links and linker cache anew each time. Medians and the
added latency from one run; prints figures, asserts nothing. Root only. BENCH_RUNS sets the runs per variant
(80); BENCH_HOST_MOUNTS=N adds N mounts on the host first, as on a node running many pods.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.conftest import make_rootfs  # noqa: E402
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100  # noqa: E402

from devinject.install.hooksd import hook_command, runc_hooks  # noqa: E402

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def compile_bytecode() -> None:
    """As an install does: with PYTHONDONTWRITEBYTECODE set, every run would otherwise recompile edited modules."""
    import compileall

    import devinject

    compileall.compile_dir(os.path.dirname(devinject.__file__), quiet=1)


def main() -> int:
    compile_bytecode()
    if os.geteuid() != 0 or shutil.which("runc") is None:
        print("bench_hook: needs root and runc (make system-deps)")
        return 0
    runs = int(os.environ.get("BENCH_RUNS", "80"))  # this VM is noisy: with 40 runs, medians moved by 2 ms
    if runs < 2:
        print(f"bench_hook: BENCH_RUNS={runs}: needs at least 2 runs (medians and quartiles)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-hook-", dir="/run" if os.path.isdir("/run") else None))
    # On a tmpfs: the hook's state dir (ledger, caches), as /run is on a production host; and each container's
    # upper layer, standing in for a server's local disk. This VM's disk takes ~0.8 ms to create a file in an
    # overlay (40 files: 33 ms, against 0.8 ms on tmpfs), which would swamp everything else measured here.
    fast = work / "tmpfs"
    state = fast / "state"
    # BENCH_HOST_MOUNTS=N: a busy node's mount table (pods' rootfs, secrets, shm...), N small tmpfs mounts on
    # the host, which every container's mount namespace starts with a copy of
    crowd = [fast / "crowd" / str(i) for i in range(int(os.environ.get("BENCH_HOST_MOUNTS", "0")))]
    server: subprocess.Popen[bytes] | None = None
    try:
        fast.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=256m", "devinject-bench", str(fast)],
                       check=True)
        for point in crowd:
            point.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "devinject-crowd", str(point)], check=True)
        builder = LibBuilder()
        build_hgx_h100(builder, FakeHost(work / "host", real_nodes=True))
        shutil.rmtree(builder.tmp, ignore_errors=True)
        subprocess.run([DEVINJECT, "generate", "--root", str(work / "host"), "--output-dir", str(work / "cdi"),
                        "--hook-path", DEVINJECT],
                       check=True, capture_output=True)
        bundle = work / "bundle"
        (bundle / "rootfs").mkdir(parents=True)
        # The image: each container gets a fresh overlay on it, as containerd's snapshotter gives runc, so the
        # hook creates its mount targets, links and linker cache in an empty upper layer every time.
        image = make_rootfs(work / "image")
        layers = fast / "layers"
        subprocess.run(["runc", "spec"], cwd=bundle, check=True)
        base = json.loads((bundle / "config.json").read_text())
        base["process"].update(terminal=False, args=["true"])

        def configure(variant: tuple[str, list[str]] | None) -> None:
            config = json.loads(json.dumps(base))
            if variant is not None and variant[0] == "floor":  # a hook that does nothing, in each stage
                hook = {"path": variant[1][0], "args": variant[1], "timeout": 30}
                config["hooks"] = {"prestart": [hook], "poststop": [hook]}
            elif variant is not None:
                stages, hook_args = variant
                hook_args = hook_args if "--server" in hook_args else [*hook_args, "--no-server"]
                hooks = runc_hooks(hook_command(), poststop=stages == "poststop")["hooks"]  # as install-hook
                for hook in (entry for entries in hooks.values() for entry in entries):
                    hook["args"] += ["--spec-dir", str(work / "cdi"), "--state-dir", str(state),
                                     "--log-file", str(work / "hook.log"), *hook_args]
                config["hooks"] = hooks
                config["annotations"] = {"cdi.k8s.io/bench": "nvidia.com/gpu=all"}
            (bundle / "config.json").write_text(json.dumps(config))

        def runc(*args: str) -> float:
            start = time.perf_counter()
            subprocess.run(["runc", *args], cwd=bundle, check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return (time.perf_counter() - start) * 1000

        def one_run() -> tuple[float, float]:
            """(create + start: the container-start path with prestart, delete: teardown with poststop)."""
            name = f"bench-{uuid.uuid4().hex[:8]}"
            upper, scratch = layers / name / "upper", layers / name / "work"
            upper.mkdir(parents=True)
            scratch.mkdir()
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={image},upperdir={upper},workdir={scratch}", str(bundle / "rootfs")], check=True)
            try:
                started = runc("create", name) + runc("start", name)
                while json.loads(subprocess.run(["runc", "state", name], capture_output=True, text=True).stdout
                                 or "{}").get("status") not in ("stopped", None):
                    time.sleep(0.001)
                return started, runc("delete", name)
            finally:
                subprocess.run(["umount", str(bundle / "rootfs")], check=True)
                shutil.rmtree(layers / name)

        interpreter = [sys.executable, "-IS", "-c", "import os; os._exit(0)"]
        server_socket = work / "server" / "hook.sock"
        server = subprocess.Popen([DEVINJECT, "hook-server", "--socket", str(server_socket)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            if server_socket.exists():
                break
            time.sleep(0.025)
        labels: dict[str, tuple[str, list[str]] | None] = {
            "without hook": None,
            "hook, ledger off": ("prestart", ["--no-ledger"]),
            "hook, ledger on": ("prestart", []),  # as installed: no poststop (release follows the death)
            "  + poststop": ("poststop", []),  # `install-hook --poststop`: the release logged at once
            "  via hook-server": ("prestart", ["--server", str(server_socket)]),  # `devinject hook-server`
            "  + poststop, served": ("poststop", ["--server", str(server_socket)]),
            "floor: /bin/true": ("floor", ["/bin/true"]),  # any hook: runc's exec and wait
            "floor: python -IS": ("floor", interpreter),  # a Python hook that does nothing
        }
        starts: dict[str, list[float]] = {label: [] for label in labels}
        stops: dict[str, list[float]] = {label: [] for label in labels}
        for args in labels.values():  # warm-up: caches, page cache
            configure(args)
            one_run()
        order = list(labels.items())
        for _ in range(runs):  # interleaved in a fresh random order, so drift and position hit all three alike
            random.shuffle(order)
            for label, args in order:
                configure(args)
                begin, end = one_run()
                starts[label].append(begin)
                stops[label].append(end)
        spec = (work / "cdi" / "nvidia.com-gpu.yaml").read_text()
        print(f"runc, {runs} runs each, medians (8 GPUs, {spec.count('containerPath:')} driver file mounts, "
              f"{len(Path('/proc/self/mountinfo').read_text().splitlines())} mounts on the host):")
        base_start, base_stop = statistics.median(starts["without hook"]), statistics.median(stops["without hook"])
        for label, variant in labels.items():
            start_ms, stop_ms = statistics.median(starts[label]), statistics.median(stops[label])
            extra = "" if variant is None or variant[0] == "floor" else (
                f"   added to start {start_ms - base_start:5.1f} ms (target <= {base_start / 2:.1f}: half the bare"
                f" start), to delete {stop_ms - base_stop:5.1f} ms (target <= 10)")
            quartiles = statistics.quantiles(starts[label], n=4)
            if variant is not None and variant[0] == "floor":
                extra = f"   added to start {start_ms - base_start:5.1f} ms, to delete {stop_ms - base_stop:5.1f} ms"
            print(f"  {label:18} create+start {start_ms:6.1f} ms (IQR {quartiles[0]:.1f}-{quartiles[2]:.1f})"
                  f"  delete {stop_ms:6.1f} ms{extra}")
        log = [json.loads(line) for line in (work / "hook.log").read_text().splitlines()]
        print("  the hook's own duration and its phases (its log, medians):")
        groups = {"ledger off": lambda r: "ledger" not in r["ms"],
                  "ledger on": lambda r: "ledger" in r["ms"] and "server" not in r,
                  "via server": lambda r: "server" in r}
        for group, belongs in groups.items():
            chosen = [r["ms"] for r in log if r.get("stage") == "prestart" and "ms" in r and belongs(r)]
            names = sorted({name for p in chosen for name in p})
            shown = "  ".join(f"{name} {statistics.median(p.get(name, 0) for p in chosen):.1f}" for name in names)
            own_ms = statistics.median(r["duration_ms"] for r in log if r.get("stage") == "prestart"
                                       and "ms" in r and belongs(r))
            print(f"    {group:10}: {own_ms:.1f} ms; {shown} (ms)")
    finally:
        if server is not None:  # also when a run failed or the output was cut off
            server.terminate()
            server.wait(10)
        subprocess.run("runc list -q | grep '^bench-' | xargs -r -n1 runc delete -f", shell=True,
                       capture_output=True)
        subprocess.run(["umount", str(work / "bundle" / "rootfs")], capture_output=True)  # after an interruption
        for point in crowd:
            subprocess.run(["umount", str(point)], capture_output=True)
        subprocess.run(["umount", str(fast)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
