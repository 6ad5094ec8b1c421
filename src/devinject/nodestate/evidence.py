"""Live evidence of the device nodes running containers use: what the ledger is rebuilt from when its file
is lost or corrupt, so that a device the node shows in use is never handed out again.

Evidence is what only root can make: a device cgroup that grants a node by name. Three sources, each tied
to a live process (so the rebuilt booking ends when that process does):
- cgroup v1: every `devices` cgroup with processes, its `devices.list` rules for single nodes (an
  unrestricted `a *:* rwm` cgroup names no node);
- cgroup v2: the rules of devinject's own prefix on each cgroup's device program;
- nodes held open by a container's process: in another mount namespace than this one, opened for I/O
  (not an `O_PATH` handle, which needs no permission on the node and opens no driver), and granted by
  name by the process's own device cgroup (the two sources above). Opening a node is no evidence by
  itself: anyone can make a mount namespace (`unshare -Urm`), and a monitoring agent or a privileged pod
  keeps every GPU open without being granted any.
The booking's process is the cgroup's container init (pid 1 of a pid namespace of its own) where there is
one, so a short-lived `exec` in the container does not end the booking early; its pod (read from its
`/proc/<pid>/cgroup`, podcgroup.py) goes with it, so a DRA claim reserved for that pod is no clash with it.
"""

from __future__ import annotations

import os

from devinject.cdi.identity import node_id, node_id_of_stat
from devinject.linux.mountinfo import parse_mountinfo
from devinject.nodestate.podcgroup import pod_of

O_PATH = getattr(os, "O_PATH", 0o10000000)  # the fdinfo `flags:` bit (octal), generic Linux value

TYPE_CHECKING = False  # the hook rebuilds a lost ledger: `typing` stays off its start path
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


class Holding(NamedTuple):
    source: str  # where the evidence was seen, for the event log and the booking's name
    pid: int  # a live process the use belongs to
    nodes: tuple[str, ...]  # "c 195:0"
    pod: str | None = None  # the Kubernetes pod of that process (its cgroup: podcgroup.py), if any


def rule_nodes(lines: list[str]) -> tuple[str, ...]:
    """Nodes named by device cgroup rules (`c 195:0 rwm`); wildcards name none."""
    nodes = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] in ("c", "b") and "*" not in fields[1]:
            nodes.append(f"{fields[0]} {fields[1]}")
    return tuple(dict.fromkeys(nodes))


def _is_namespace_init(pid: int, proc: str) -> bool:
    """Whether `pid` is pid 1 of a pid namespace below this one (`NSpid:` lists its pid in each)."""
    try:
        with open(f"{proc}/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    numbers = line.split()[1:]
                    return len(numbers) > 1 and numbers[-1] == "1"
    except OSError:
        pass
    return False


def _container_pid(directory: str, proc: str = "/proc") -> int | None:
    """The process a cgroup's booking is tied to: its container's init where it has one, else its lowest
    pid; None when the cgroup has no process."""
    try:
        with open(os.path.join(directory, "cgroup.procs"), encoding="ascii") as handle:
            pids = sorted(int(line) for line in handle.read().split() if line.isdigit())
    except OSError:
        return None
    for pid in pids:
        if _is_namespace_init(pid, proc):
            return pid
    return pids[0] if pids else None


def cgroup_holdings(mountinfo: str, proc: str = "/proc") -> list[Holding]:
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
            pid = _container_pid(directory, proc)
            if pid is None:
                continue
            nodes = _v1_nodes(directory) if v1 else _v2_nodes(directory)
            if nodes:
                found.append(Holding(f"cgroup v{1 if v1 else 2} {directory}", pid, nodes, pod_of(pid, proc)))
    return found


def _v1_nodes(directory: str) -> tuple[str, ...]:
    try:
        with open(os.path.join(directory, "devices.list"), encoding="ascii") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ()
    return () if "a *:* rwm" in lines else rule_nodes(lines)


def _v2_nodes(directory: str) -> tuple[str, ...]:
    from devinject.linux import devprogram

    return tuple(dict.fromkeys(node_id(r.type, r.major, r.minor) for r in devprogram.granted_rules(directory)))


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


def granted_nodes(pid: int, proc: str = "/proc") -> frozenset[str]:
    """The nodes process `pid`'s own device cgroup grants by name (v1 `devices.list`, v2 devinject's
    prefix): what makes its use of a node a container's. Empty when it is unrestricted or gone."""
    from devinject.core.errors import DevinjectError
    from devinject.linux.devcgroup import device_cgroup_of

    try:
        cgroup = device_cgroup_of(pid, proc)
    except DevinjectError:
        return frozenset()
    if cgroup is None:
        return frozenset()
    return frozenset(_v1_nodes(cgroup.path) if cgroup.version == 1 else _v2_nodes(cgroup.path))


def container_holders(nodes: set[str] | None, proc: str = "/proc") -> dict[str, list[int]]:
    """Containers' processes holding one of `nodes` (None: any node) open for I/O, with the node granted by
    their own device cgroup: node -> pids. Scans /proc/*/fd of the processes in other mount namespaces."""
    found: dict[str, list[int]] = {}
    for pid in processes(proc, other_mount_namespaces=True):
        held = [node for node in open_device_nodes(pid, proc) if nodes is None or node in nodes]
        if not held:
            continue
        granted = granted_nodes(pid, proc)  # one cgroup lookup, and only for a process holding a wanted node
        for node in held:
            if node in granted:
                found.setdefault(node, []).append(pid)
    return found


def open_node_holdings(proc: str = "/proc") -> list[Holding]:
    """Device nodes held open by containers' processes (container_holders), one holding per process."""
    by_pid: dict[int, list[str]] = {}
    for node, pids in container_holders(None, proc).items():
        for pid in pids:
            by_pid.setdefault(pid, []).append(node)
    return [Holding(f"open by pid {pid}", pid, tuple(nodes), pod_of(pid, proc))
            for pid, nodes in sorted(by_pid.items())]


def _opened_for_io(fdinfo: str) -> bool:
    """Whether a descriptor (its /proc/<pid>/fdinfo/<fd>) opened its file, rather than being an `O_PATH`
    handle, which anyone who can see a node may take: it needs no permission and opens no driver."""
    try:
        with open(fdinfo, "rb") as handle:
            for line in handle:
                if line.startswith(b"flags:"):
                    return not int(line.split()[1], 8) & O_PATH
    except (OSError, ValueError, IndexError):
        pass
    return False  # gone, or unreadable: nothing to go by


def open_device_nodes(pid: int, proc: str = "/proc") -> tuple[str, ...]:
    """The device nodes (`c 195:0`) process `pid` holds open for I/O (no `O_PATH` handle); () when it is
    gone."""
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
        if identity is not None and _opened_for_io(f"{proc}/{pid}/fdinfo/{fd}"):
            nodes.append(identity)
    return tuple(dict.fromkeys(nodes))


def collect(proc: str = "/proc") -> list[Holding]:
    try:
        with open(f"{proc}/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            mountinfo = handle.read()
    except OSError:
        mountinfo = ""
    return cgroup_holdings(mountinfo, proc) + open_node_holdings(proc)
