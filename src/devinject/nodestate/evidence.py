"""Live evidence of the device nodes running containers use: what the ledger is rebuilt from when its file
is lost or corrupt, so that a device the node shows in use is never handed out again.

Three sources, each tied to a live process (so the rebuilt booking ends when that process does):
- cgroup v1: every `devices` cgroup with processes, its `devices.list` rules for single nodes (an
  unrestricted `a *:* rwm` cgroup names no node);
- cgroup v2: the rules of devinject's own prefix on each cgroup's device program;
- nodes held open by processes in another mount namespace than this one (containers; a host daemon such
  as a persistence daemon keeping every GPU open is not a container's use).
"""

from __future__ import annotations

import os

from devinject.core.identity import node_id, node_id_of_stat
from devinject.core.mountinfo import parse_mountinfo

TYPE_CHECKING = False  # the hook rebuilds a lost ledger: `typing` stays off its start path
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


class Holding(NamedTuple):
    source: str  # where the evidence was seen, for the event log and the booking's name
    pid: int  # a live process the use belongs to
    nodes: tuple[str, ...]  # "c 195:0"


def rule_nodes(lines: list[str]) -> tuple[str, ...]:
    """Nodes named by device cgroup rules (`c 195:0 rwm`); wildcards name none."""
    nodes = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] in ("c", "b") and "*" not in fields[1]:
            nodes.append(f"{fields[0]} {fields[1]}")
    return tuple(dict.fromkeys(nodes))


def _first_pid(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, "cgroup.procs"), encoding="ascii") as handle:
            line = handle.readline().strip()
    except OSError:
        return None
    return int(line) if line.isdigit() else None


def cgroup_holdings(mountinfo: str) -> list[Holding]:
    found: list[Holding] = []
    seen: set[tuple[int, int]] = set()
    for mount in parse_mountinfo(mountinfo):
        v1 = mount.fstype == "cgroup" and "devices" in mount.super_options
        if not v1 and mount.fstype != "cgroup2":
            continue
        for directory, _, _ in os.walk(mount.mount_point):
            try:
                st = os.stat(directory)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            pid = _first_pid(directory)
            if pid is None:
                continue
            nodes = _v1_nodes(directory) if v1 else _v2_nodes(directory)
            if nodes:
                found.append(Holding(f"cgroup v{1 if v1 else 2} {directory}", pid, nodes))
    return found


def _v1_nodes(directory: str) -> tuple[str, ...]:
    try:
        with open(os.path.join(directory, "devices.list"), encoding="ascii") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ()
    return () if "a *:* rwm" in lines else rule_nodes(lines)


def _v2_nodes(directory: str) -> tuple[str, ...]:
    from devinject.hook import bpf

    return tuple(dict.fromkeys(node_id(r.type, r.major, r.minor) for r in bpf.granted_rules(directory)))


def processes(proc: str = "/proc", *, other_mount_namespaces: bool = False) -> list[int]:
    """Every process's pid; with `other_mount_namespaces`, only those in a mount namespace other than this
    process's (containers: a host daemon such as a persistence daemon keeping every GPU open is not one)."""
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
        own = os.stat(f"{proc}/self/ns/mnt").st_ino if other_mount_namespaces else None
    except OSError:
        return []
    if own is None:
        return pids
    others = []
    for pid in pids:
        try:
            if os.stat(f"{proc}/{pid}/ns/mnt").st_ino != own:
                others.append(pid)
        except OSError:
            continue  # gone, or its namespace hidden from us
    return others


def open_node_holdings(proc: str = "/proc") -> list[Holding]:
    """Device nodes held open by processes in a mount namespace other than this process's."""
    found = []
    for pid in processes(proc, other_mount_namespaces=True):
        nodes = open_device_nodes(pid, proc)
        if nodes:
            found.append(Holding(f"open by pid {pid}", pid, nodes))
    return found


def open_device_nodes(pid: int, proc: str = "/proc") -> tuple[str, ...]:
    """The device nodes (`c 195:0`) process `pid` holds open; () when it is gone."""
    fd_dir = f"{proc}/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return ()
    nodes = []
    for fd in fds:
        try:
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        identity = node_id_of_stat(st)
        if identity is not None:
            nodes.append(identity)
    return tuple(dict.fromkeys(nodes))


def collect(proc: str = "/proc") -> list[Holding]:
    try:
        with open(f"{proc}/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            mountinfo = handle.read()
    except OSError:
        mountinfo = ""
    return cgroup_holdings(mountinfo) + open_node_holdings(proc)
