#!/usr/bin/env python3
"""Benchmark what a spec's CDI hooks add to a container start on a runtime that applies CDI itself, against the
OCI hook served by `devinject hook-server` (the path for runtimes that do not).

`runc create` + `runc start` of a trivial container with one GPU of the HGX H100 host (nvidia.com/gpu=0: its
nodes and the driver's files, real mknod nodes), the spec's edits applied to config.json as a CDI runtime
applies them (mounts, device nodes and their cgroup rules, createContainer hooks), on a fresh overlay rootfs
each time (a snapshotter's):
- `CDI edits, no hooks`: the baseline of the CDI rows: what the runtime does before any hook;
- `today: 2 hooks, console script`: the spec as generate wrote it before (create-symlinks and update-ldcache,
  each a run of the `devinject` console script: an interpreter with `site`); BENCH_BEFORE=REV runs them on
  that git revision's code (e.g. the commit before the merged hook), else on this tree's;
- `1 hook, launcher -IS`: as generate writes it now (links-and-ldcache, this interpreter on the hook launcher);
- `1 hook, launcher -IS, served`: the same hook handed to the running hook server (`--server`), whose worker
  joins the container's mount namespace and runs it with its imports done;
- `1 hook, node hook`: the same hook through the node hook bundle (install/nodehook.py, installed in the
  scratch host root) as `generate --node-hook` names it: its loader and interpreter, no launcher;
- `1 hook, node hook's launcher`: the same through the bundle's /bin/sh launcher (a `--hook-path` naming it);
- `floor: /bin/true hook`: one createContainer hook that does nothing: the runtime's own cost of a hook;
- `NVIDIA: 3 hooks`: NVIDIA's own hooks (`nvidia-cdi-hook` 1.20.0 from ../shared/peers, or BENCH_PEERS) as its
  spec names them: create-symlinks (the same links), enable-cuda-compat (the host driver's version),
  update-ldcache (the same folder): what the devinject rows are held to (≤ 0.6x, wall and CPU);
- `bare` and `OCI hook, served`: no CDI edits, without and with `devinject hook` as prestart (install-hook's
  command) handed to a hook server: the reference the CDI hooks were held to before.
Interleaved in a fresh random order each round; medians; prints figures, asserts nothing. Root only.
BENCH_RUNS (100) sets the rounds: a start's IQR spans ~10-15 ms on this VM against differences of ~1 ms, and at 30
rounds two runs of one tree read 0.55x and 0.64x for one row.

CPU: each start's CPU time is runc's and its prestart hooks' (this process's children's rusage around `runc
create` + `start`) plus the container's cgroup (cpuacct: runc init, the createContainer hooks it runs, the
container's `true`); a served row adds what the hook server spent on its request: the server runs in a cpuacct
cgroup of its own (the server and its workers: the worker's request and its return to its own namespace, or
for a worker that exits after its request its exit and the replacement the server forks), read before the
request and again once the server is idle after it. `added` is over the CDI baseline's
median (over bare for the OCI hook), wall and CPU alike. The server runs as its unit runs it (no -v); a served
request is checked served: the server spent at least MIN_SERVED_MS on it (a worker took it) and refused none.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import random
import resource
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
from bench.bench_hook import compile_bytecode  # noqa: E402
from tests.e2e.conftest import make_rootfs, oci_edits  # noqa: E402
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100  # noqa: E402

from devinject.cdi.model import ContainerEdits, Hook  # noqa: E402
from devinject.cdi.spec import load_file  # noqa: E402
from devinject.install.hooksd import hook_command, runc_hooks  # noqa: E402
from devinject.install.nodehook import install_node_hook  # noqa: E402

DEVINJECT = str(Path(sys.executable).parent / "devinject")
DEVICE = "0"
PEERS = Path(os.environ.get("BENCH_PEERS", REPO.parent / "shared" / "peers"))
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
SETTLE_S = 3.0  # at most, for the hook server to be idle again after a request (its replacement worker ready)
MIN_SERVED_MS = 1.0  # a cdi-hook a worker took costs the server 3-4 ms (the hook's work), an OCI hook ~10; idle, ~0


def nvidia_cdi_hook(work: Path) -> str | None:
    """NVIDIA's hook binary, unpacked from the peers' dir and checked against its SHA256SUMS; None if absent."""
    packed, sums = PEERS / "nvidia-cdi-hook.xz", PEERS / "SHA256SUMS"
    if not packed.exists() or not sums.exists():
        return None
    expected = next((line.split()[0] for line in sums.read_text().splitlines()
                     if line.split()[1:] == ["nvidia-cdi-hook"]), None)
    data = lzma.decompress(packed.read_bytes())
    if hashlib.sha256(data).hexdigest() != expected:
        raise RuntimeError(f"{packed}: not the file {sums} names")
    binary = work / "nvidia-cdi-hook"
    binary.write_bytes(data)
    binary.chmod(0o755)
    return str(binary)


def nvidia_hooks(merged: Hook, binary: str) -> tuple[Hook, ...]:
    """NVIDIA's hooks as its spec names them, for what devinject's one hook `merged` makes: its links, the CUDA
    compat check for the host driver's version, its library folders."""
    from devinject.hook.plan import parse_cdi_hook, parse_forward_compat

    _, values = parse_cdi_hook(list(merged.args[merged.args.index("links-and-ldcache"):]))
    version = parse_forward_compat(values["--forward-compat"][0]).host_version
    hook = Hook("createContainer", binary, ())
    return (hook._replace(args=("nvidia-cdi-hook", "create-symlinks", *(a for v in values["--link"]
                                                                       for a in ("--link", v)))),
            hook._replace(args=("nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={version}")),
            hook._replace(args=("nvidia-cdi-hook", "update-ldcache", *(a for v in values["--folder"]
                                                                      for a in ("--folder", v)))))


def cpuacct_ns(group: str) -> int:
    """The CPU time (ns) a cgroup v1 cpuacct group has used."""
    return int((CPUACCT / group.lstrip("/") / "cpuacct.usage").read_text())


def children_cpu_ns() -> int:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round((usage.ru_utime + usage.ru_stime) * 1e9)


def settled_ns(group: str) -> int:
    """The group's CPU time once it stops growing (the server idle again), within SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    time.sleep(0.3)  # the server forks a replacement 0.2 s after a request
    last = cpuacct_ns(group)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = cpuacct_ns(group)
        if now == last:
            break
        last = now
    return last


def split_hook(hook: Hook, path: str) -> tuple[Hook, ...]:
    """The merged hook as generate wrote it before: create-symlinks then update-ldcache, by `path`."""
    args = list(hook.args)
    rest = args[args.index("links-and-ldcache") + 1:]
    pairs = list(zip(rest[::2], rest[1::2], strict=True))
    links = [a for flag, value in pairs if flag == "--link" for a in (flag, value)]
    cache = [a for flag, value in pairs if flag != "--link" for a in (flag, value)]
    return (hook._replace(path=path, args=("devinject", "cdi-hook", "create-symlinks", *links)),
            hook._replace(path=path, args=("devinject", "cdi-hook", "update-ldcache", *cache)))


def before_script(work: Path) -> str:
    """A console script like the installed one; on BENCH_BEFORE's code when set (its src/ extracted here)."""
    revision = os.environ.get("BENCH_BEFORE")
    if not revision:
        return DEVINJECT
    old = work / "before"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    import compileall

    compileall.compile_dir(str(old / "src"), quiet=1)
    script = work / "before-bin" / "devinject"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(old / 'src')!r})\n"
                      "from devinject.entry import main\nif __name__ == '__main__':\n    sys.exit(main())\n")
    script.chmod(0o755)
    return str(script)


def main() -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # clean up (containers, mounts, server) when stopped
    compile_bytecode()
    if os.geteuid() != 0 or shutil.which("runc") is None:
        print("bench_cdi_hooks: needs root and runc (make system-deps)")
        return 0
    if not (CPUACCT / "cpuacct.usage").exists():
        print(f"bench_cdi_hooks: needs cgroup v1's cpuacct at {CPUACCT} (each start's CPU time is read there)")
        return 0
    runs = int(os.environ.get("BENCH_RUNS", "100"))
    if runs < 2:
        print(f"bench_cdi_hooks: BENCH_RUNS={runs}: needs at least 2 runs", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-cdi-", dir="/run" if os.path.isdir("/run") else None))
    fast = work / "tmpfs"  # overlay upper layers and the hook's state on a tmpfs, as in bench_hook.py
    server: subprocess.Popen[bytes] | None = None
    server_group = f"devinject-bench-server-{uuid.uuid4().hex[:8]}"
    try:
        nvidia = nvidia_cdi_hook(work)
        if nvidia is None:
            print(f"bench_cdi_hooks: needs NVIDIA's hook: {PEERS}/nvidia-cdi-hook.xz and SHA256SUMS (BENCH_PEERS)")
            return 0
        fast.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=256m", "devinject-bench", str(fast)],
                       check=True)
        builder = LibBuilder()
        build_hgx_h100(builder, FakeHost(work / "host", real_nodes=True))
        shutil.rmtree(builder.tmp, ignore_errors=True)
        node_hook = install_node_hook(str(work / "host"), "/opt/devinject/hook").hook_path
        specs = {}
        for name, how in (("launcher", ("--hook-path", DEVINJECT)), ("node", ("--node-hook", "/opt/devinject/hook")),
                          ("node launcher", ("--hook-path", str(work / "host") + node_hook))):
            subprocess.run([DEVINJECT, "generate", "--root", str(work / "host"), "--output-dir",
                            str(work / f"cdi-{name}"), *how], check=True, capture_output=True)
            spec = load_file(work / f"cdi-{name}" / "nvidia.com-gpu.yaml")
            device = next(d for d in spec.devices if d.name == DEVICE)
            specs[name] = spec.edits.merge(device.edits)
        (merged,) = specs["launcher"].hooks
        assert merged.args[1] == "-IS" and "links-and-ldcache" in merged.args, merged.args
        today = specs["launcher"]._replace(hooks=split_hook(merged, before_script(work)))
        floor = specs["launcher"]._replace(hooks=(Hook("createContainer", "/bin/true", ("true",)),))
        incumbent = specs["launcher"]._replace(hooks=nvidia_hooks(merged, nvidia))
        bundle = work / "bundle"
        (bundle / "rootfs").mkdir(parents=True)
        image = make_rootfs(work / "image")
        layers = fast / "layers"
        subprocess.run(["runc", "spec"], cwd=bundle, check=True)
        base = json.loads((bundle / "config.json").read_text())
        base["process"].update(terminal=False, args=["true"])
        server_socket = work / "server" / "hook.sock"
        server_log = work / "server.log"  # as its unit runs it (no -v: a line per request costs ~0.5 ms of CPU)
        with open(server_log, "w") as log:
            server = subprocess.Popen([DEVINJECT, "hook-server", "--socket", str(server_socket)],
                                      stdout=subprocess.DEVNULL, stderr=log)
        (CPUACCT / server_group).mkdir()
        (CPUACCT / server_group / "cgroup.procs").write_text(str(server.pid))  # its workers are forked there
        for _ in range(200):
            if server_socket.exists():
                break
            time.sleep(0.025)
        served_hooks = tuple(h._replace(args=(*h.args, "--server", str(server_socket)))
                             for h in specs["launcher"].hooks)
        subprocess.run([DEVINJECT, "generate", "--root", str(work / "host"), "--output-dir", str(work / "cdi-oci"),
                        "--hook-path", DEVINJECT], check=True, capture_output=True)

        def configure(variant: ContainerEdits | str | None, name: str) -> None:
            config = json.loads(json.dumps(base))
            config["linux"]["cgroupsPath"] = f"/{name}"  # its CPU time read from cpuacct before runc delete
            if isinstance(variant, ContainerEdits):
                edits = oci_edits(variant)
                config["mounts"] += edits["mounts"]
                config["linux"]["devices"] = edits["devices"]
                config["linux"]["resources"]["devices"] += edits["rules"]
                if edits["hooks"]:
                    config["hooks"] = {"createContainer": edits["hooks"]}
            elif variant == "served":  # as install-hook writes it (prestart only), handed to the server
                hooks = runc_hooks(hook_command(), server=str(server_socket))["hooks"]
                for hook in hooks["prestart"]:
                    hook["args"] += ["--spec-dir", str(work / "cdi-oci"), "--state-dir", str(fast / "state"),
                                     "--log-file", str(work / "hook.log")]
                config["hooks"] = hooks
                config["annotations"] = {"cdi.k8s.io/bench": f"nvidia.com/gpu={DEVICE}"}
            (bundle / "config.json").write_text(json.dumps(config))

        errors = work / "runc.err"

        def runc(*args: str) -> float:
            start = time.perf_counter()
            with open(errors, "w") as err:  # a file, not a pipe: `runc init` keeps it open until `start`
                done = subprocess.run(["runc", *args], cwd=bundle, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=err)
            if done.returncode != 0:
                raise RuntimeError(f"{current}: runc {args[0]}: {errors.read_text().strip()[-2000:]}")
            return (time.perf_counter() - start) * 1000

        def one_run(name: str) -> tuple[float, float]:
            """One start: its wall time and its CPU time (runc's and the container's cgroup's), in ms."""
            upper, scratch = layers / name / "upper", layers / name / "work"
            upper.mkdir(parents=True)
            scratch.mkdir()
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={image},upperdir={upper},workdir={scratch}", str(bundle / "rootfs")], check=True)
            try:
                before = children_cpu_ns()
                started = runc("create", name) + runc("start", name)
                runc_cpu = children_cpu_ns() - before
                while json.loads(subprocess.run(["runc", "state", name], capture_output=True, text=True).stdout
                                 or "{}").get("status") not in ("stopped", None):
                    time.sleep(0.001)
                if (upper / "etc" / "ld.so.cache").exists() != current_hooks:  # only a hook writes one
                    raise RuntimeError(f"{current}: a linker cache {'missing' if current_hooks else 'unasked for'}")
                container_cpu = cpuacct_ns(name)
                runc("delete", name)
                return started, (runc_cpu + container_cpu) / 1e6
            finally:
                subprocess.run(["umount", str(bundle / "rootfs")], check=True)
                shutil.rmtree(layers / name)

        labels: dict[str, ContainerEdits | str | None] = {
            "CDI edits, no hooks": specs["launcher"]._replace(hooks=()),
            "today: 2 hooks, console script": today,
            "1 hook, launcher -IS": specs["launcher"],
            "1 hook, launcher -IS, served": specs["launcher"]._replace(hooks=served_hooks),
            "1 hook, node hook": specs["node"],
            "1 hook, node hook's launcher": specs["node launcher"],
            "floor: /bin/true hook": floor,
            "NVIDIA: 3 hooks": incumbent,
            "bare": None,
            "OCI hook, served": "served",
        }
        current, current_hooks = "", False
        starts: dict[str, list[float]] = {label: [] for label in labels}
        cpus: dict[str, list[float]] = {label: [] for label in labels}
        server_cpus: dict[str, list[float]] = {label: [] for label in labels if "served" in label}
        order = list(labels.items())
        for round_ in range(runs + 1):  # the first round warms caches and is not counted
            random.shuffle(order)
            for label, variant in order:
                name = f"bench-{uuid.uuid4().hex[:8]}"
                configure(variant, name)
                current = label
                current_hooks = variant == "served" or (isinstance(variant, ContainerEdits) and any(
                    "cdi-hook" in h.args or "update-ldcache" in h.args for h in variant.hooks))
                served_before = cpuacct_ns(server_group) if label in server_cpus else 0
                took, cpu = one_run(name)
                server_cpu = (settled_ns(server_group) - served_before) / 1e6 if label in server_cpus else 0.0
                if label in server_cpus and server_cpu < MIN_SERVED_MS:  # never a silent fall back to in-process
                    raise RuntimeError(f"{label}: the hook server spent {server_cpu:.2f} ms: no worker took it")
                if round_:
                    starts[label].append(took)
                    cpus[label].append(cpu + server_cpu)
                    if label in server_cpus:
                        server_cpus[label].append(server_cpu)
        if "refused" in server_log.read_text():  # a worker took it, and ran it in-process after all
            raise RuntimeError(f"the hook server refused a request: {server_log.read_text().strip()[-2000:]}")
        medians = {label: statistics.median(values) for label, values in starts.items()}
        cpu_medians = {label: statistics.median(values) for label, values in cpus.items()}

        def added(label: str) -> tuple[float, float]:
            base_label = "bare" if label == "OCI hook, served" else "CDI edits, no hooks"
            return medians[label] - medians[base_label], cpu_medians[label] - cpu_medians[base_label]

        nvidia_wall, nvidia_cpu = added("NVIDIA: 3 hooks")
        print(f"runc create+start, {runs} rounds interleaved, medians (nvidia.com/gpu={DEVICE}: "
              f"{len(specs['launcher'].mounts)} driver mounts, {len(specs['launcher'].device_nodes)} nodes); "
              f"CPU: runc's, the container cgroup's and a served row's hook server's:")
        for label in labels:
            quartiles = statistics.quantiles(starts[label], n=4)
            line = (f"  {label:34} {medians[label]:6.1f} ms (IQR {quartiles[0]:.1f}-{quartiles[2]:.1f}), "
                    f"CPU {cpu_medians[label]:6.1f} ms")
            if label not in ("bare", "CDI edits, no hooks"):
                wall, cpu = added(label)
                line += f"  added {wall:5.1f} ms wall, {cpu:5.1f} ms CPU"
                if label not in ("NVIDIA: 3 hooks", "OCI hook, served", "floor: /bin/true hook"):
                    line += f" ({wall / nvidia_wall:.2f}x / {cpu / nvidia_cpu:.2f}x NVIDIA's)"
            if label in server_cpus:
                line += f"; the server's CPU per request {statistics.median(server_cpus[label]):.1f} ms"
            print(line)
        in_process, served = added("1 hook, launcher -IS"), added("1 hook, launcher -IS, served")
        print(f"targets: devinject <= 0.6x NVIDIA's (+{nvidia_wall:.1f} ms wall, +{nvidia_cpu:.1f} ms CPU): in-process "
              f"{in_process[0] / nvidia_wall:.2f}x / {in_process[1] / nvidia_cpu:.2f}x, served "
              f"{served[0] / nvidia_wall:.2f}x / {served[1] / nvidia_cpu:.2f}x (wall / CPU); served CPU "
              f"<= in-process: {served[1]:.1f} against {in_process[1]:.1f} ms ({served[1] / in_process[1]:.2f}x)")
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        if (CPUACCT / server_group).exists():
            (CPUACCT / server_group).rmdir()
        subprocess.run("runc list -q | grep '^bench-' | xargs -r -n1 runc delete -f", shell=True,
                       capture_output=True)
        subprocess.run(["umount", str(work / "bundle" / "rootfs")], capture_output=True)
        subprocess.run(["umount", str(fast)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
