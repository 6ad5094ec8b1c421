"""Grant device access in the container's device cgroup.

Which cgroup and which version is linux/devcgroup.py's (`device_cgroup_of`, from `/proc/<pid>/cgroup` and the
mounts). v1 appends rules to `devices.allow`; v2 rewrites the attached BPF_CGROUP_DEVICE program (bpf.py).

Rules added here live outside the OCI config: a systemd reload that re-applies the unit's device policy can
reset them (docs/hook.md explains the `/dev/char` links that avoid this).
"""

from __future__ import annotations

import os

from devinject.core.errors import HookError
from devinject.linux.devcgroup import AllowDevice, DeviceCgroup
from devinject.linux.devcgroup import device_cgroup_of as device_cgroup_of  # the hook's, with the grant


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
