"""`hook --dry-run` is the real run with an executor that performs nothing: the same request, run for real
(under runc, or the executor in a private mount namespace) and dry, lists the same steps in the same words,
and what the real run changed in the container is what those steps name."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from devinject.hook.main import DryRunParts, HookOptions
from devinject.hook.plan import BindMount, ForwardCompat, MakeNode, Plan, Symlink
from tests.e2e.conftest import Bundle, container_name, in_private_mount_ns, require

pytestmark = pytest.mark.live


def dry_run(bundle: Bundle, container_id: str) -> dict[str, object]:
    """`devinject hook --dry-run` for the bundle, as its prestart hook is configured (pid 0: no container)."""
    hook = bundle.config["hooks"]["prestart"][0]
    state = {"ociVersion": "1.0.2", "id": container_id, "status": "creating", "pid": 0, "bundle": str(bundle.path)}
    done = subprocess.run([hook["path"], *hook["args"][1:], "--dry-run"], input=json.dumps(state),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    record: dict[str, object] = json.loads(done.stdout)
    assert record["result"] == "dry run"
    return record


def same_steps(real: list[str], dry: list[str]) -> bool:
    """Step for step the dry run's entries; a real entry may add how it went (`<step>; present`)."""
    return len(real) == len(dry) and all(r == d or r.startswith(d + "; ") for r, d in zip(real, dry, strict=True))


def test_a_runc_run_takes_exactly_the_steps_its_dry_run_lists(bundle: Bundle) -> None:
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    name = container_name()
    dry = dry_run(bundle, name)
    done = bundle.run(name)
    assert done.returncode == 0, done.stdout + done.stderr
    (real,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert real["result"] == "ok" and real["devices"] == dry["devices"]
    assert real["steps"] == dry["steps"]  # a fresh rootfs: nothing found done, every entry as the dry run says
    steps = dry["steps"]
    assert isinstance(steps, list)
    assert {step.split()[0] for step in steps} == {"mknod", "bind", "symlink", "ld.so.cache"}, steps


def test_a_second_stage_finds_each_listed_step_done(bundle: Bundle) -> None:
    """prestart and createRuntime both configured: the second run walks the same steps and says each node,
    mount and link is present (the linker cache is written again)."""
    bundle.config["hooks"]["createRuntime"] = [bundle.config["hooks"]["prestart"][0]]
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "nvidia.com/gpu=0"})
    name = container_name()
    dry = dry_run(bundle, name)
    done = bundle.run(name)
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = [r["steps"] for r in bundle.log_records() if r.get("stage") == "prestart"]
    steps = dry["steps"]
    assert isinstance(steps, list)
    assert first == steps
    assert second == [s if s.startswith("ld.so.cache") else f"{s}; present" for s in steps]


# The executor in a mount namespace of its own, on `plan` (its repr); prints its log, the paths it made in
# the rootfs and the mounts it attached there. With "drift": an executor that also does one thing more.
APPLY = """
import json, os, sys
from devinject.hook import executor
from devinject.hook.main import DryRunParts, HookOptions
from devinject.hook.plan import BindMount, ForwardCompat, MakeNode, Plan, Symlink

rootfs, plan, how = sys.argv[1], eval(sys.argv[2]), sys.argv[3]


class Drifting(executor.Executor):
    def symlink(self, link):
        done = super().symlink(link)
        os.symlink("x", os.path.join(self.rootfs, "usr/lib/unlisted"))  # a step no walk lists
        return done


def tree():
    return {"/" + os.path.relpath(os.path.join(top, name), rootfs)
            for top, dirs, files in os.walk(rootfs) for name in dirs + files}


before = tree()
log = (Drifting if how == "drift" else executor.Executor)(rootfs).apply(plan)
with open("/proc/self/mountinfo") as handle:
    mounts = [line.split()[4] for line in handle]
print(json.dumps({"log": log, "made": sorted(tree() - before),
                  "mounts": sorted("/" + os.path.relpath(m, rootfs) for m in mounts if m.startswith(rootfs + "/"))}))
"""


def unlisted(dry: list[str], effects: dict[str, list[str]]) -> list[str]:
    """What the real run made or mounted in the rootfs that no dry-run step names (nor a directory on the
    way to one)."""
    named, mounted = set(), set()
    for step in dry:
        words = step.split()
        if words[0] == "ld.so.cache":
            named.add("/etc/ld.so.cache")
        else:
            path = words[3] if words[0] == "bind" else words[1]
            named.add(path)
            if words[0] == "bind":
                mounted.add(path)
    on_the_way = {os.path.dirname(p) for p in named}
    while "/" not in on_the_way:
        on_the_way |= {os.path.dirname(p) for p in on_the_way}
    return sorted({p for p in effects["made"] if p not in named | on_the_way}
                  | {m for m in effects["mounts"] if m not in mounted})


@pytest.fixture
def every_step(tmp_path: Path) -> tuple[Path, Plan]:
    """A rootfs, and a plan with a step of every kind (a node, file and directory mounts, a link, the linker
    cache with a forward-compat directory that wins)."""
    require(os.geteuid() == 0, "needs root (mknod, mount)")
    rootfs = tmp_path / "rootfs"
    compat = rootfs / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.999.1").write_bytes(b"")
    host = tmp_path / "host"
    (host / "share").mkdir(parents=True)
    (host / "libfake.so.1").write_bytes(b"\x7fELF not really")
    plan = Plan(nodes=(MakeNode("/dev/fake0", "c", 1, 3, 0o666, 0, 0, "/dev/null"),),
                mounts=(BindMount(str(host / "libfake.so.1"), "/usr/lib/fake/libfake.so.1"),
                        BindMount(str(host / "share"), "/usr/share/fake", readonly=False)),
                links=(Symlink("libfake.so.1", "/usr/lib/fake/libfake.so"),),
                ldcache_folders=("/usr/lib/fake",),
                forward_compat=(ForwardCompat("/usr/local/cuda/compat", "libcuda.so", "550.54.14"),))
    return rootfs, plan


def recorded(plan: Plan) -> list[str]:
    """The dry run's steps for `plan`, as `hook --dry-run` takes them."""
    return DryRunParts(HookOptions()).apply(0, "/nonexistent", plan)


def _apply(rootfs: Path, plan: Plan, how: str = "") -> dict[str, list[str]]:
    done = in_private_mount_ns(APPLY, str(rootfs), repr(plan), how)
    assert done.returncode == 0, done.stderr
    effects: dict[str, list[str]] = json.loads(done.stdout)
    return effects


def test_the_executor_does_what_the_dry_run_lists_and_nothing_else(every_step: tuple[Path, Plan]) -> None:
    rootfs, plan = every_step
    dry = recorded(plan)
    effects = _apply(rootfs, plan)
    assert same_steps(effects["log"], dry), (effects["log"], dry)
    assert effects["log"][-1].endswith("; forward compat /usr/local/cuda/compat first (libcuda.so 999.1 > 550.54.14)")
    assert unlisted(dry, effects) == []
    assert effects["mounts"] == ["/usr/lib/fake/libfake.so.1", "/usr/share/fake"]
    assert {"/dev/fake0", "/usr/lib/fake/libfake.so", "/etc/ld.so.cache"} <= set(effects["made"])


def test_a_step_the_dry_run_does_not_list_fails_the_comparison(every_step: tuple[Path, Plan]) -> None:
    """The check above can fail: an executor that makes one link more than its steps say is caught."""
    rootfs, plan = every_step
    effects = _apply(rootfs, plan, "drift")
    assert same_steps(effects["log"], recorded(plan))  # its log alone does not show it
    assert unlisted(recorded(plan), effects) == ["/usr/lib/unlisted"]
