"""/proc/<pid>/mountinfo, parsed once for everyone who reads it (the cgroup finder, the shared-mount check
before the hook attaches a mount, the ledger's recovery evidence). Lean: the hook uses it."""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


class MountEntry(NamedTuple):
    mount_id: str
    root: str
    mount_point: str
    fstype: str
    super_options: tuple[str, ...]
    optional: tuple[str, ...] = ()  # propagation tags: "shared:N", "master:N", ...

    @property
    def shared(self) -> bool:
        """A mount attached below this one propagates to its peers (`shared:N`)."""
        return any(tag.startswith("shared:") for tag in self.optional)


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def parse_mountinfo(text: str, *, mount_id: str | None = None) -> list[MountEntry]:
    """Every mount, or only the one with `mount_id`: a node running many containers has thousands of mounts,
    and the hook looks one up on every container start."""
    prefix = f"{mount_id} " if mount_id is not None else ""
    entries = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        left, sep, right = line.partition(" - ")
        fields = left.split()
        tail = right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        entries.append(MountEntry(fields[0], _unescape(fields[3]), _unescape(fields[4]), tail[0],
                                  tuple(tail[2].split(",")), tuple(fields[6:])))
    return entries
