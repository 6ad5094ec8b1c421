"""Which Kubernetes pod a process belongs to, from its `/proc/<pid>/cgroup`: the kubelet puts every container
of a pod in the pod's cgroup, whose name carries the pod's UID, and only root makes or moves into cgroups
there. An OCI annotation or an environment variable would be the image's or the pod user's word; the cgroup
is the kubelet's.

The kubelet's own layouts, from the hierarchy's root (its default cgroup root `/`), on cgroup v1 (every
controller's line) and v2 (the `0::` line) alike:
- cgroupfs: `/kubepods/pod<uid>/<container>` (Guaranteed), `/kubepods/{burstable,besteffort}/pod<uid>/...`;
- systemd: `/kubepods.slice/kubepods-pod<uid>.slice/...`, `/kubepods.slice/kubepods-<qos>.slice/
  kubepods-<qos>-pod<uid with - as _>.slice/...`.
Only a path that starts there counts: a `kubepods` directory anywhere below (a user's delegated systemd
subtree, a container's own cgroup namespace writing below its cgroup) is no pod, and a process whose lines
name two pods is in none.
"""

from __future__ import annotations

QOS_CLASSES = ("burstable", "besteffort")
_HEX = frozenset("0123456789abcdef")


def _uid(text: str) -> str | None:
    """A pod UID as the kubelet writes it: a UUID (8-4-4-4-12 lowercase hex), or a static pod's 32 hex
    digits; None for anything else."""
    groups = text.split("-")
    if [len(g) for g in groups] not in ([8, 4, 4, 4, 12], [32]) or not all(set(g) <= _HEX for g in groups):
        return None
    return text


def _cgroupfs(parts: list[str]) -> str | None:
    # parts[0] == "kubepods"
    rest = parts[2:] if len(parts) > 2 and parts[1] in QOS_CLASSES else parts[1:]
    return _uid(rest[0][3:]) if rest and rest[0].startswith("pod") else None


def _systemd(parts: list[str]) -> str | None:
    # parts[0] == "kubepods.slice"
    if len(parts) < 2:
        return None
    base = "kubepods"
    for qos in QOS_CLASSES:
        if parts[1] == f"kubepods-{qos}.slice":
            if len(parts) < 3:
                return None
            base, parts = f"kubepods-{qos}", parts[1:]
            break
    name = parts[1]
    prefix = f"{base}-pod"
    if not (name.startswith(prefix) and name.endswith(".slice")):
        return None
    escaped = name[len(prefix):-len(".slice")]
    return None if "-" in escaped else _uid(escaped.replace("_", "-"))


def path_pod_uid(path: str) -> str | None:
    """The pod UID a cgroup path (from its hierarchy's root) names, or None."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return None
    if parts[0] == "kubepods":
        return _cgroupfs(parts)
    if parts[0] == "kubepods.slice":
        return _systemd(parts)
    return None


def parse_pod_uid(text: str) -> str | None:
    """Pure: the pod UID of a process from the text of its `/proc/<pid>/cgroup` (`id:controllers:path`
    lines); None when no line is a pod's or two lines name different pods."""
    found = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            uid = path_pod_uid(parts[2])
            if uid is not None:
                found.add(uid)
    return found.pop() if len(found) == 1 else None


def pod_of(pid: int, proc: str = "/proc") -> str | None:
    """The pod UID of process `pid`; None when it is no pod's, or gone."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
            return parse_pod_uid(handle.read())
    except OSError:
        return None
