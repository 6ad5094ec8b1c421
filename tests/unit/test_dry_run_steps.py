"""The dry run and the executor share one walk through a plan and one wording of its steps: a plan field or
an executor step outside that walk is caught here (tests/e2e/test_dry_run_live.py compares real runs)."""

from __future__ import annotations

from devinject.hook.executor import (
    ApplicationProfile,
    Executor,
    LinkerCache,
    RecordingExecutor,
    Steps,
    describe,
    plan_steps,
)
from devinject.hook.plan import AllowDevice, BindMount, ForwardCompat, MakeNode, Plan, Symlink

WALKED = {"nodes", "mounts", "links", "ldcache_folders", "forward_compat", "gpu_minors"}  # the executor's
ORCHESTRATED = {"allow", "net_devices", "warnings"}  # run_hook's: the cgroup grant, network moves, the record
NODE = MakeNode("/dev/x0", "c", 1, 3, 0o660, 0, 44, "/dev/null")
MOUNT = BindMount("/host/lib.so", "/usr/lib/lib.so")
LINK = Symlink("lib.so", "/usr/lib/lib.so.1")
COMPAT = ForwardCompat("/usr/local/cuda/compat", "libcuda.so", "550.54.14")
PLAN = Plan(nodes=(NODE,), mounts=(MOUNT, BindMount("/host/share", "/usr/share/x", readonly=False)), links=(LINK,),
            ldcache_folders=("/usr/lib", "/opt/lib"), allow=(AllowDevice("c", 1, 3, "rwm"),), forward_compat=(COMPAT,),
            gpu_minors=(1,))


def test_every_field_of_a_plan_is_walked_by_the_executor_or_handled_by_the_hook() -> None:
    """A new kind of step in Plan fails here until it is in the walk (and so in the dry run) or run_hook's."""
    assert set(Plan._fields) == WALKED | ORCHESTRATED
    assert plan_steps(PLAN) == [NODE, *PLAN.mounts, LINK, ApplicationProfile((1,)),
                                LinkerCache(("/usr/lib", "/opt/lib"), (COMPAT,))]


def test_the_executor_takes_its_steps_only_through_the_shared_walk() -> None:
    """The executor carries out each kind of step the walk knows (none is left to the base's do-nothing) and
    has no walk of its own; the recording executor is that do-nothing base and overrides nothing."""
    actions = {name for name, value in vars(Steps).items()
               if callable(value) and name not in ("__init__", "take", "apply", "rollback", "close")}
    assert actions == {"make_node", "bind_mount", "symlink", "update_ldcache", "write_application_profile"}
    assert actions <= set(vars(Executor))
    assert not {"take", "apply"} & set(vars(Executor))
    assert not {name for name, value in vars(RecordingExecutor).items() if callable(value)}


def test_the_dry_run_lists_each_step_in_the_executors_words() -> None:
    assert RecordingExecutor().apply(PLAN) == [
        "mknod /dev/x0 c 1:3 mode 660 owner 0:44",
        "bind /host/lib.so -> /usr/lib/lib.so (ro)",
        "bind /host/share -> /usr/share/x",
        "symlink /usr/lib/lib.so.1 -> lib.so",
        "application profile /etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf: "
        "EGLVisibleDGPUDevices 0x2",
        "ld.so.cache += /usr/lib /opt/lib",
    ]
    assert [describe(step) for step in plan_steps(PLAN)] == RecordingExecutor().apply(PLAN)
    assert RecordingExecutor().apply(Plan(allow=PLAN.allow)) == []  # the grant is run_hook's, not a step here
