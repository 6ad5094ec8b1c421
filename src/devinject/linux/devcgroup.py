"""A process's device cgroup, read only: which cgroup and which version, from `/proc/<pid>/cgroup` and the
mounts, never from guesses (cgroup v2 when `/sys/fs/cgroup` is a cgroup2 mount, what runc checks, else v1's
`devices` hierarchy), and the device rule a grant is made of. The hook grants in it (hook/cgroup.py); the
ledger's evidence reads what it grants (nodestate/evidence.py). cgroup v2's device program is read in
linux/devprogram.py."""

from __future__ import annotations

import os

from devinject.core.errors import HookError

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


class AllowDevice(NamedTuple):
    type: str
    major: int
    minor: int
    access: str

    @property
    def rule(self) -> str:
        return f"{self.type} {self.major}:{self.minor} {self.access}"


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
    from devinject.linux.mountinfo import parse_mountinfo  # here: the plan's AllowDevice alone needs none of it

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
    from devinject.linux.statmount import mount_magic_and_root

    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return mount_magic_and_root(fd)
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
