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
- `bare` and `OCI hook, served`: no CDI edits, without and with `devinject hook` as prestart (install-hook's
  command) handed to a hook server: the reference the CDI hooks are held to.
Interleaved in a fresh random order each round; medians; prints figures, asserts nothing. Root only.
BENCH_RUNS (30) sets the rounds.
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
from bench.bench_hook import compile_bytecode  # noqa: E402
from tests.e2e.conftest import make_rootfs, oci_edits  # noqa: E402
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100  # noqa: E402

from devinject.cdi.model import ContainerEdits, Hook  # noqa: E402
from devinject.cdi.spec import load_file  # noqa: E402
from devinject.install.hooksd import hook_command, runc_hooks  # noqa: E402
from devinject.install.nodehook import install_node_hook  # noqa: E402

DEVINJECT = str(Path(sys.executable).parent / "devinject")
DEVICE = "0"


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
    runs = int(os.environ.get("BENCH_RUNS", "30"))
    if runs < 2:
        print(f"bench_cdi_hooks: BENCH_RUNS={runs}: needs at least 2 runs", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="devinject-bench-cdi-", dir="/run" if os.path.isdir("/run") else None))
    fast = work / "tmpfs"  # overlay upper layers and the hook's state on a tmpfs, as in bench_hook.py
    server: subprocess.Popen[bytes] | None = None
    try:
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
        bundle = work / "bundle"
        (bundle / "rootfs").mkdir(parents=True)
        image = make_rootfs(work / "image")
        layers = fast / "layers"
        subprocess.run(["runc", "spec"], cwd=bundle, check=True)
        base = json.loads((bundle / "config.json").read_text())
        base["process"].update(terminal=False, args=["true"])
        server_socket = work / "server" / "hook.sock"
        server_log = work / "server.log"  # -v: a line for each cdi-hook it serves, counted below
        with open(server_log, "w") as log:
            server = subprocess.Popen([DEVINJECT, "-v", "hook-server", "--socket", str(server_socket)],
                                      stdout=subprocess.DEVNULL, stderr=log)
        for _ in range(200):
            if server_socket.exists():
                break
            time.sleep(0.025)
        served_hooks = tuple(h._replace(args=(*h.args, "--server", str(server_socket)))
                             for h in specs["launcher"].hooks)
        subprocess.run([DEVINJECT, "generate", "--root", str(work / "host"), "--output-dir", str(work / "cdi-oci"),
                        "--hook-path", DEVINJECT], check=True, capture_output=True)

        def configure(variant: ContainerEdits | str | None) -> None:
            config = json.loads(json.dumps(base))
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

        def one_run() -> float:
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
                if (upper / "etc" / "ld.so.cache").exists() != current_hooks:  # only a hook writes one
                    raise RuntimeError(f"{current}: a linker cache {'missing' if current_hooks else 'unasked for'}")
                runc("delete", name)
                return started
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
            "bare": None,
            "OCI hook, served": "served",
        }
        current, current_hooks = "", False
        starts: dict[str, list[float]] = {label: [] for label in labels}
        order = list(labels.items())
        for round_ in range(runs + 1):  # the first round warms caches and is not counted
            random.shuffle(order)
            for label, variant in order:
                configure(variant)
                current = label
                current_hooks = variant == "served" or (isinstance(variant, ContainerEdits) and any(
                    "cdi-hook" in h.args for h in variant.hooks))
                took = one_run()
                if round_:
                    starts[label].append(took)
        served_count = server_log.read_text().count("cdi-hook served for pid")
        if served_count != runs + 1:  # never a silent fall back to in-process
            raise RuntimeError(f"the hook server served {served_count} cdi-hooks of {runs + 1}")
        medians = {label: statistics.median(values) for label, values in starts.items()}
        cdi_base, bare = medians["CDI edits, no hooks"], medians["bare"]
        served = medians["OCI hook, served"] - bare
        print(f"runc create+start, {runs} rounds interleaved, medians (nvidia.com/gpu={DEVICE}: "
              f"{len(specs['launcher'].mounts)} driver mounts, {len(specs['launcher'].device_nodes)} nodes):")
        for label in labels:
            quartiles = statistics.quantiles(starts[label], n=4)
            if label in ("bare", "OCI hook, served"):
                added = "" if label == "bare" else f"  added {served:5.1f} ms over bare (the reference)"
            else:
                extra = medians[label] - cdi_base
                added = "" if label.startswith("CDI edits") else \
                    f"  added {extra:5.1f} ms ({extra / served:.2f}x the served OCI hook's)"
            print(f"  {label:34} {medians[label]:6.1f} ms (IQR {quartiles[0]:.1f}-{quartiles[2]:.1f}){added}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        subprocess.run("runc list -q | grep '^bench-' | xargs -r -n1 runc delete -f", shell=True,
                       capture_output=True)
        subprocess.run(["umount", str(work / "bundle" / "rootfs")], capture_output=True)
        subprocess.run(["umount", str(fast)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
