"""Grant device access in the container's device cgroup.

Which cgroup and which version come from `/proc/<pid>/cgroup` and the mount table, never from guesses:
cgroup v2 when `/sys/fs/cgroup` is a cgroup2 mount (what runc checks), else v1's `devices` hierarchy.
v1 appends rules to `devices.allow`; v2 rewrites the attached BPF_CGROUP_DEVICE program (see bpf.py).

Rules added here live outside the OCI config: a systemd reload that re-applies the unit's device policy can
reset them (docs/hook.md explains the `/dev/char` links that avoid this).
"""

from __future__ import annotations

import os

from devinject.core.errors import HookError
from devinject.core.mountinfo import parse_mountinfo
from devinject.hook.plan import AllowDevice

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


CGROUP_ROOT = "/sys/fs/cgroup"


class DeviceCgroup(NamedTuple):
    version: int
    path: str  # directory of the container's cgroup on this host's view


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """controller (or '' for the v2 unified line) -> path."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for controller in controllers.split(","):
            if controller:
                out[controller] = path
    return out


def _join(mount_point: str, mount_root: str, cgroup_path: str) -> str:
    """The directory of `cgroup_path` under a hierarchy mounted at `mount_point` from `mount_root` of it."""
    root = mount_root.rstrip("/")
    relative = cgroup_path[len(root):] if root and cgroup_path.startswith(root) else cgroup_path
    return os.path.normpath(mount_point + "/" + relative.lstrip("/"))


def find_device_cgroup(mountinfo: str, proc_cgroup: str) -> DeviceCgroup | None:
    """Pure: the device cgroup directory for a process, or None when it has no device controller."""
    # Only cgroup mounts and what is mounted on /sys/fs/cgroup are parsed: a node running many containers
    # has thousands of other mounts, and this runs on every container start.
    wanted = (line for line in mountinfo.splitlines() if " - cgroup" in line or f" {CGROUP_ROOT} " in line)
    mounts = parse_mountinfo("\n".join(wanted))
    paths = parse_proc_cgroup(proc_cgroup)
    at_root = [m for m in mounts if m.mount_point == CGROUP_ROOT]
    if at_root and at_root[-1].fstype == "cgroup2":  # the last mount on a point is the visible one
        if "" not in paths:
            return None
        return DeviceCgroup(2, _join(at_root[-1].mount_point, at_root[-1].root, paths[""]))
    devices = [m for m in mounts if m.fstype == "cgroup" and "devices" in m.super_options]
    if devices and "devices" in paths:
        return DeviceCgroup(1, _join(devices[-1].mount_point, devices[-1].root, paths["devices"]))
    unified = [m for m in mounts if m.fstype == "cgroup2"]
    if unified and "" in paths:
        return DeviceCgroup(2, _join(unified[-1].mount_point, unified[-1].root, paths[""]))
    return None


CGROUP2_SUPER_MAGIC = 0x63677270
CGROUP_SUPER_MAGIC = 0x27E0EB
V1_DEVICES = CGROUP_ROOT + "/devices"


def _mount_at(path: str) -> tuple[int, str] | None:
    """(filesystem magic, mount root) of the mount visible at `path`, from statmount."""
    from devinject.hook import syscalls

    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return syscalls.mount_magic_and_root(fd)
    finally:
        os.close(fd)


def standard_device_cgroup(proc_cgroup: str) -> tuple[bool, DeviceCgroup | None]:
    """(whether the standard layout answers, the device cgroup) from the mounts at the standard places, asked
    of the kernel one by one (statmount, Linux >= 6.8): cgroup v2 when /sys/fs/cgroup is cgroup2, else v1's
    devices hierarchy at /sys/fs/cgroup/devices. Anything else (or an older kernel) is not answered: the
    caller reads the mount table, which lists every mount on the node (8 ms with 3,000 of them)."""
    paths = parse_proc_cgroup(proc_cgroup)
    top = _mount_at(CGROUP_ROOT)
    if top is None:
        return False, None
    magic, root = top
    if magic == CGROUP2_SUPER_MAGIC:
        return True, DeviceCgroup(2, _join(CGROUP_ROOT, root, paths[""])) if "" in paths else None
    devices = _mount_at(V1_DEVICES)
    if devices is None or devices[0] != CGROUP_SUPER_MAGIC or "devices" not in paths \
            or not os.path.exists(V1_DEVICES + "/devices.allow"):
        return False, None
    return True, DeviceCgroup(1, _join(V1_DEVICES, devices[1], paths["devices"]))


def device_cgroup_of(pid: int, proc: str = "/proc") -> DeviceCgroup | None:
    try:
        with open(f"{proc}/{pid}/cgroup") as handle:
            proc_cgroup = handle.read()
        if proc == "/proc":  # this host's own mounts (not a fixture tree)
            answered, found = standard_device_cgroup(proc_cgroup)
            if answered:
                return found
        with open(f"{proc}/self/mountinfo") as handle:
            mountinfo = handle.read()
    except OSError as err:
        raise HookError(f"container process {pid}: cannot read its cgroup: {err.strerror}") from None
    return find_device_cgroup(mountinfo, proc_cgroup)


class CgroupGrant:
    """Adds rules; `revert()` takes back exactly what this grant added."""

    def __init__(self, cgroup: DeviceCgroup) -> None:
        self.cgroup = cgroup
        self.added_v1: list[str] = []
        self.v2_swap: object | None = None

    def allow(self, rules: tuple[AllowDevice, ...]) -> None:
        if not rules:
            return
        if self.cgroup.version == 1:
            self._allow_v1(rules)
        else:
            from devinject.hook import bpf

            self.v2_swap = bpf.allow_devices(self.cgroup.path, rules)

    def _allow_v1(self, rules: tuple[AllowDevice, ...]) -> None:
        listed = set()
        try:
            with open(os.path.join(self.cgroup.path, "devices.list")) as handle:
                listed = {line.strip() for line in handle}
        except OSError:
            pass
        allow_file = os.path.join(self.cgroup.path, "devices.allow")
        wanted = [rule.rule for rule in rules if rule.rule not in listed and "a *:* rwm" not in listed]
        if not wanted:
            return
        try:
            fd = os.open(allow_file, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as err:
            raise HookError(f"{allow_file}: cannot add {wanted[0]!r}: {err.strerror}") from None
        try:
            for rule in wanted:  # one rule per write(2): the kernel parses each write on its own
                try:
                    os.write(fd, rule.encode())
                except OSError as err:
                    raise HookError(f"{allow_file}: cannot add {rule!r}: {err.strerror}") from None
                self.added_v1.append(rule)
        finally:
            os.close(fd)

    def revert(self) -> None:
        if self.cgroup.version == 1:
            deny = os.path.join(self.cgroup.path, "devices.deny")
            for rule in reversed(self.added_v1):
                try:
                    with open(deny, "w") as handle:
                        handle.write(rule)
                except OSError:
                    pass
            self.added_v1.clear()
        elif self.v2_swap is not None:
            from devinject.hook import bpf

            bpf.restore(self.v2_swap)
            self.v2_swap = None

    def done(self) -> None:
        if self.v2_swap is not None:
            from devinject.hook import bpf

            bpf.release(self.v2_swap)
            self.v2_swap = None
