"""The hook's edges without a runtime: user namespaces, and many hooks racing for the same devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devinject.cdi.spec import load_file
from devinject.linux.ldcache import parse_ldcache
from tests.e2e.conftest import DEVINJECT, require, stand_ins, write_spec_dir
from tests.unit.test_cdi_hook_lean import CDI_HOOK_MODULES, NOT_IMPORTED

pytestmark = pytest.mark.live
REPO = Path(__file__).resolve().parents[2]


def hook_run(bundle: Path, container_id: str, pid: int, request: str | None, *args: str,
             command: tuple[str, ...] = (DEVINJECT,), timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """One `devinject hook` run as a runtime makes it: a bundle (rootfs, config.json with the request as a
    CDI annotation) and the OCI state on stdin. No request: the container's poststop."""
    state: dict[str, object] = {"ociVersion": "1.0.2", "id": container_id, "bundle": str(bundle)}
    if request is None:
        state["status"] = "stopped"
    else:
        (bundle / "rootfs" / "dev").mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"},
                                                        "annotations": {"cdi.k8s.io/test": request}}))
        state.update(status="creating", pid=pid)
    return subprocess.run([*command, "hook", *args], input=json.dumps(state), capture_output=True, text=True,
                          timeout=timeout)


def test_mknod_not_permitted_falls_back_to_binding_the_host_node(tmp_path: Path) -> None:
    """In a user namespace mknod fails with EPERM: the host node is bind-mounted instead."""
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare")
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    code = (
        "import os, sys\n"
        "from devinject.hook.executor import Executor\n"
        "from devinject.hook.plan import MakeNode, Plan\n"
        f"rootfs = {str(rootfs)!r}\n"
        "node = MakeNode('/dev/fake-null', 'c', 1, 3, 0o666, 0, 0, '/dev/null')\n"
        "steps = Executor(rootfs).apply(Plan(nodes=(node,)))\n"
        "st = os.stat(rootfs + '/dev/fake-null')\n"
        "print(steps[0]); print(os.major(st.st_rdev), os.minor(st.st_rdev))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "mknod not permitted" in done.stdout
    assert done.stdout.split()[-2:] == ["1", "3"]  # the host's /dev/null, bind-mounted


def test_fifty_hooks_racing_for_eight_devices_never_double_allocate(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "needs root")
    devices = "".join(f"- name: '{i}'\n  containerEdits:\n    deviceNodes: [{{path: /dev/race{i}, type: c, "
                      f"major: 1, minor: {200 + i}}}]\n" for i in range(8))
    spec_dir = write_spec_dir(tmp_path / "cdi", "race.yaml",
                              f"cdiVersion: 0.5.0\nkind: race.example/dev\ndevices:\n{devices}")
    state_dir = tmp_path / "state"
    with stand_ins(50) as sleepers:
        for round_number in range(3):
            def one(index: int, round_number: int = round_number) -> subprocess.CompletedProcess[str]:
                return hook_run(tmp_path / f"b{round_number}-{index}", f"r{round_number}-{index}",
                                sleepers[index].pid, f"race.example/dev={index % 8}", "--spec-dir", str(spec_dir),
                                "--state-dir", str(state_dir), "--log-file", str(tmp_path / "hook.log"), timeout=120)

            with ThreadPoolExecutor(max_workers=50) as pool:
                results = list(pool.map(one, range(50)))
            winners = [r for r in results if r.returncode == 0]
            losers = [r for r in results if r.returncode != 0]
            assert len(winners) == 8, [r.stderr for r in losers][:3]
            assert all("is held by container" in r.stderr for r in losers), [r.stderr for r in losers][:3]
            ledger = json.loads((state_dir / "ledger.json").read_text())["allocations"]
            held = [node for entry in ledger.values() for node in entry["exclusive"]]
            assert len(held) == len(set(held)) == 8
            for container in list(ledger):  # poststop for everyone, then the next round
                done = hook_run(tmp_path, container, 0, None, "--state-dir", str(state_dir), "--log-file", "/dev/null")
                assert done.returncode == 0, done.stderr
            left = json.loads((state_dir / "ledger.json").read_text())["allocations"]
            assert {entry["state"] for entry in left.values()} <= {"reclaiming"}  # released (or already gone)


def test_a_node_without_numbers_in_the_spec_is_still_exclusive(tmp_path: Path) -> None:
    """Other generators write `deviceNodes: [{path: /dev/nvidia0}]`: the hook books the host node's own
    numbers, so two containers cannot both hold it under different names."""
    require(os.geteuid() == 0, "needs root")
    spec_dir = write_spec_dir(tmp_path / "cdi", "bare.yaml", (
        "cdiVersion: 0.5.0\nkind: bare.example/dev\ndevices:\n"
        "- name: a\n  containerEdits:\n    deviceNodes: [{path: /dev/bare, hostPath: /dev/null}]\n"
        "- name: b\n  containerEdits:\n    deviceNodes: [{path: /dev/other-name, hostPath: /dev/null}]\n"))
    with stand_ins(2) as sleepers:
        results = [hook_run(tmp_path / f"b{index}", f"bare-{index}", sleepers[index].pid, f"bare.example/dev={name}",
                            "--spec-dir", str(spec_dir), "--state-dir", str(tmp_path / "state"), "--log-file",
                            "/dev/null") for index, name in enumerate(("a", "b"))]
        assert results[0].returncode == 0, results[0].stderr
        assert results[1].returncode != 0
        assert "device c 1:3 is held by container bare-0" in results[1].stderr


def test_a_hook_that_fails_after_booking_gives_the_device_back(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "needs root")
    spec_dir = write_spec_dir(tmp_path / "cdi", "x.yaml", (
        "cdiVersion: 0.5.0\nkind: cancel.example/dev\ndevices:\n- name: a\n  containerEdits:\n"
        "    deviceNodes: [{path: /dev/cancel0, type: c, major: 1, minor: 240}]\n"
        f"    mounts: [{{hostPath: {tmp_path}/absent.so, containerPath: /opt/absent.so, options: [ro, bind]}}]\n"))
    with stand_ins(1) as (sleeper,):
        bundle = tmp_path / "bundle"
        done = hook_run(bundle, "doomed", sleeper.pid, "cancel.example/dev=a", "--spec-dir", str(spec_dir),
                        "--state-dir", str(tmp_path / "state"), "--log-file", "/dev/null")
        assert done.returncode != 0 and "absent.so" in done.stderr
        ledger = json.loads((tmp_path / "state" / "ledger.json").read_text())
        assert ledger["allocations"] == {}  # the booking was cancelled with the rest
        assert not (bundle / "rootfs" / "dev" / "cancel0").exists()


# What a container start may load: the hook, the floors it builds on (core, the CDI model, the Linux toolkit),
# and the node state it books in.
HOOK_PACKAGES = ("devinject.core", "devinject.cdi", "devinject.linux", "devinject.hook", "devinject.nodestate")
HEAVY = ("click", "yaml", "jsonschema", "pynvml", "pyroute2")
SLOW_STDLIB = ("typing", "dataclasses", "pathlib", "subprocess", "inspect", "json", "re", "enum", "signal",
               "contextlib", "functools", "tempfile", "ctypes")


def test_a_real_hook_run_imports_only_the_core_it_needs(tmp_path: Path) -> None:
    """The hook's real import graph, taken from a real run (ledger, cgroup, nodes, driver mounts, linker
    cache) rather than a list: with warm caches, only core/cdi/linux/hook/nodestate modules and no slow stdlib — in
    the hook and in the child it forks into the container's mount namespace (an audit hook sees both)."""
    require(os.geteuid() == 0, "needs root (mknod, mount)")
    spec_dir = tmp_path / "cdi"
    hosts = REPO / "tests" / "fixtures" / "hosts"
    subprocess.run([DEVINJECT, "generate", "--root", str(hosts / "gaudi2"), "--output-dir", str(spec_dir),
                    "--hook-path", DEVINJECT], check=True, capture_output=True)
    # The container stand-in has a mount namespace of its own: the hook's mounts go away with it.
    with stand_ins(1, "unshare", "-m", "--propagation", "private", "sleep", "60") as (sleeper,):
        time.sleep(0.2)  # unshare has exec'd sleep in the new namespace
        imports = tmp_path / "imports"
        code = ("import sys\n"
                f"seen = open({str(imports)!r}, 'a', buffering=1)\n"
                "sys.addaudithook(lambda event, args: event == 'import' and seen.write(f'{args[0]}\\n'))\n"
                "from devinject.entry import main\n"
                "status = main(sys.argv[1:])\n"
                "sys.exit(status)\n")
        loaded = []
        for run in range(2):  # cold (YAML parsed, sharing policy read from the profiles), then warm
            imports.write_text("")
            bundle = tmp_path / f"bundle{run}"
            done = hook_run(bundle, f"imports-{run}", sleeper.pid, "habana.ai/gaudi=0", "--spec-dir", str(spec_dir),
                            "--state-dir", str(tmp_path / "state"), "--log-file", "/dev/null",
                            command=(sys.executable, "-I", "-c", code))
            assert done.returncode == 0, done.stderr
            assert (bundle / "rootfs" / "etc" / "ld.so.cache").exists()  # the whole path ran
            loaded = sorted({m for m in imports.read_text().split()
                             if m.split(".")[0] in ("devinject", *HEAVY, *SLOW_STDLIB)})
            hook_run(bundle, f"imports-{run}", 0, None, "--state-dir", str(tmp_path / "state"), "--log-file",
                     "/dev/null")
        ours = [m for m in loaded if m.startswith("devinject.") and m != "devinject.entry"]
        assert ours and all(m.startswith(HOOK_PACKAGES) for m in ours), ours
        assert "devinject.hook.executor" in ours  # the child's imports are seen too
        assert [m for m in loaded if not m.startswith("devinject")] == []


def test_a_spec_s_cdi_hook_run_as_written_imports_no_os(tmp_path: Path) -> None:
    """The spec's own CDI hook, as generate writes it for an HGX H100 GPU (this interpreter on the launcher,
    `-IS`, links-and-ldcache), run as a runtime runs it on a rootfs holding the spec's mounts (the driver's
    files) with no hook server: its links and linker cache made, and none of the standard library it no longer
    needs imported (`os` and what it pulls, ~0.9 ms of every start; itertools), nor any devinject module
    beyond the cdi-hook's own (tests/unit/test_cdi_hook_lean.py holds both lists)."""
    host = REPO / "tests" / "fixtures" / "hosts" / "hgx-h100"
    subprocess.run([DEVINJECT, "generate", "--root", str(host), "--kind", "nvidia.com/gpu", "--output-dir",
                    str(tmp_path / "cdi"), "--hook-path", DEVINJECT], check=True, capture_output=True)
    spec = load_file(tmp_path / "cdi" / "nvidia.com-gpu.yaml")
    edits = spec.edits.merge(next(d for d in spec.devices if d.name == "0").edits)
    rootfs = tmp_path / "bundle" / "rootfs"
    for mount in edits.mounts:  # what the runtime's bind mounts show the hook
        (rootfs / mount.container_path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(mount.host_path, rootfs / mount.container_path.lstrip("/"))
    devices = [{"path": n.path, "type": "c", "major": n.major, "minor": n.minor} for n in edits.device_nodes]
    (rootfs.parent / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "linux": {"devices": devices}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                        "bundle": str(rootfs.parent)})
    (hook,) = edits.hooks
    interpreter, *args = hook.args
    assert (hook.path, args[:2]) == (interpreter, ["-IS", str(REPO / "src/devinject/hook/launcher.py")])
    done = subprocess.run([hook.path, "-X", "importtime", *args, "--server", str(tmp_path / "nobody.sock")],
                          input=state, capture_output=True, text=True, env=dict(e.split("=", 1) for e in hook.env),
                          cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr
    cached = {e.soname for e in parse_ldcache((rootfs / "etc/ld.so.cache").read_bytes())}
    assert {"libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"} <= cached, cached
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line} - {"package"}
    assert not [m for m in imported if m.split(".")[0] in NOT_IMPORTED], sorted(imported)
    forward_compat = {"devinject.core.asciitext"}  # the spec's --forward-compat: the host driver's version read
    assert {m for m in imported if m.startswith("devinject")} <= CDI_HOOK_MODULES | forward_compat


def test_the_cgroup_v2_path_imports_no_slow_stdlib() -> None:
    """bpf (cgroup v2's device program) is loaded whole on every v2 container start: `platform` alone
    pulled `re`, `enum` and `collections`, ~7 ms."""
    code = ("import sys\nimport devinject.hook.bpf, devinject.hook.cgroup\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {SLOW_STDLIB!r})))\n")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO / "src")})
    assert done.returncode == 0 and done.stdout.split() == [], done.stdout + done.stderr
