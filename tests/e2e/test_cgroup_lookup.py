"""The container's device cgroup, found from the mounts at the standard places (statmount) and from the
whole mount table, on real mounts: both must give the same answer, and anything unusual must reach the
mount table."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import in_private_mount_ns, require

LOOKUP = r"""
import os, subprocess, sys
from devinject.linux import devcgroup as cgroup

setup, proc_cgroup = sys.argv[1], sys.argv[2].replace("|", "\n")
if setup == "v2":  # what runc sees on a cgroup v2 host
    subprocess.run(["mount", "-t", "cgroup2", "none", "/sys/fs/cgroup"], check=True)
elif setup == "nested":  # the devices hierarchy mounted from a cgroup below its root, as in a nested runtime
    os.makedirs("/sys/fs/cgroup/devices/di-nested", exist_ok=True)
    subprocess.run(["mount", "--bind", "/sys/fs/cgroup/devices/di-nested", "/sys/fs/cgroup/devices"], check=True)
elif setup == "elsewhere":  # the devices hierarchy not at the standard place
    subprocess.run(["umount", "/sys/fs/cgroup/devices"], check=True)
    os.makedirs("/run/di-devcg", exist_ok=True)
    subprocess.run(["mount", "-t", "cgroup", "-o", "devices", "none", "/run/di-devcg"], check=True)
answered, fast = cgroup.standard_device_cgroup(proc_cgroup)
table = cgroup.find_device_cgroup(open("/proc/self/mountinfo").read(), proc_cgroup)
print(answered, fast, table, sep=";")
if setup == "nested":  # the cgroup itself is the host's: remove it again
    subprocess.run(["umount", "/sys/fs/cgroup/devices"], check=True)
    os.rmdir("/sys/fs/cgroup/devices/di-nested")
elif setup == "elsewhere":
    subprocess.run(["umount", "/run/di-devcg"], check=True)
    os.rmdir("/run/di-devcg")
"""


def _lookup(setup: str, proc_cgroup: str) -> list[str]:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare")
    require(Path("/sys/fs/cgroup/devices/devices.allow").exists(), "needs the cgroup v1 devices hierarchy")
    done = in_private_mount_ns(LOOKUP, setup, proc_cgroup.replace("\n", "|"))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")


@pytest.mark.parametrize(("setup", "proc_cgroup", "expected"), [
    ("host", "5:devices:/runc/c1\n0::/runc/c1\n", "DeviceCgroup(version=1, path='/sys/fs/cgroup/devices/runc/c1')"),
    ("v2", "5:devices:/\n0::/di-test\n", "DeviceCgroup(version=2, path='/sys/fs/cgroup/di-test')"),
    ("nested", "5:devices:/di-nested/c1\n", "DeviceCgroup(version=1, path='/sys/fs/cgroup/devices/c1')"),
])
def test_the_standard_places_answer_as_the_mount_table_does(setup: str, proc_cgroup: str, expected: str) -> None:
    answered, fast, table = _lookup(setup, proc_cgroup)
    assert (answered, fast, table) == ("True", expected, expected)


def test_a_devices_hierarchy_elsewhere_is_left_to_the_mount_table() -> None:
    answered, fast, table = _lookup("elsewhere", "5:devices:/runc/c1\n")
    assert (answered, fast) == ("False", "None")
    assert table == "DeviceCgroup(version=1, path='/run/di-devcg/runc/c1')"
