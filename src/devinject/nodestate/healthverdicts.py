"""health.json: the node agent's published verdicts, the one file every reader of the node's health acts on.

Written by the health loop (agent/publishers.py's HealthFile, in `watch`, `device-plugin` or the DRA driver)
whenever a verdict changes, 0644 (it says nothing secret); read by the ledger (a booking of a node taken out
is refused), the DRA driver (its slices' taints), `list` and `health` (agent/healthstate.py `load_published`).

One reader rule (`read`): no file is "no agent runs, nothing is out"; a file that cannot be read, is not JSON,
has a field of the wrong type or a version this devinject does not read is a StateFileError naming the file
and the field, and no caller takes it as healthy: the ledger refuses every booking, `list`/`health` fail
naming it, the DRA driver keeps the taints it read last. The agent replaces it at its next change.
"""

from __future__ import annotations

import os

from devinject.core import atomicfile, jsonlite
from devinject.linux.trusteddir import make_dirs
from devinject.nodestate.statefile import (
    StateFileError,
    need_number,
    need_object,
    need_str,
    need_strings,
    need_version,
    read_document,
)

TYPE_CHECKING = False  # the ledger reads this on the hook's path: `typing` stays off it
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

HEALTH_FILE = "health.json"
VERSION = 1  # a file without `version` (written before it had one) is version 1
STATUSES = ("healthy", "degraded", "unhealthy")  # agent/health.py's verdicts
UNHEALTHY = "unhealthy"


class DeviceVerdict(NamedTuple):
    """One device as the agent published it: `published` is what the specs, the kubelet, the ledger and the DRA
    driver act on; `status` and `reasons` the verdict of its latest check (None: not checked yet)."""
    published: str
    status: str | None = None
    reasons: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"published": self.published, "status": self.status, "reasons": list(self.reasons)}

    @classmethod
    def from_json(cls, raw: object, at: str) -> DeviceVerdict:
        entry = need_object(raw, at)
        status = entry.get("status")
        return cls(_status(entry.get("published"), f"{at}.published"),
                   None if status is None else _status(status, f"{at}.status"),
                   need_strings(entry.get("reasons", []), f"{at}.reasons"))


class HealthVerdicts(NamedTuple):
    """health.json's contents: the device nodes taken out (what the ledger refuses) and each device's verdict by
    its key (`nvidia.com/gpu=0000:18:00.0`). A field a file leaves out reads as empty."""
    unhealthy_nodes: tuple[str, ...]
    devices: dict[str, DeviceVerdict]
    time: float = 0.0
    version: int = VERSION

    def to_json(self) -> dict[str, object]:
        return {"version": self.version, "time": self.time, "unhealthy_nodes": list(self.unhealthy_nodes),
                "devices": {key: verdict.to_json() for key, verdict in self.devices.items()}}

    @classmethod
    def from_json(cls, raw: object, path: str) -> HealthVerdicts:
        data = need_object(raw, path)
        version = need_version(data, path, (VERSION,))
        devices = need_object(data.get("devices", {}), f"{path}.devices")
        when = data.get("time")
        return cls(need_strings(data.get("unhealthy_nodes", []), f"{path}.unhealthy_nodes"),
                   {str(key): DeviceVerdict.from_json(entry, f"{path}.devices[{key!r}]")
                    for key, entry in devices.items()},
                   0.0 if when is None else need_number(when, f"{path}.time"), version)

    def taken_out(self) -> dict[str, tuple[str, ...]]:
        """The devices published unhealthy, with the reasons of their latest check, by key."""
        return {key: v.reasons for key, v in self.devices.items() if v.published == UNHEALTHY}


def _status(value: object, at: str) -> str:
    if value not in STATUSES:
        raise StateFileError(f"{at}: expected one of {', '.join(STATUSES)}")
    return need_str(value, at)


def health_path(state_dir: str) -> str:
    return os.path.join(state_dir, HEALTH_FILE)


def read(state_dir: str) -> HealthVerdicts | None:
    """The verdicts the agent published; None when no agent wrote any. StateFileError naming the file and
    the field when it cannot be believed."""
    path = health_path(state_dir)
    raw = read_document(path, what="the agent's health verdicts")
    return None if raw is None else HealthVerdicts.from_json(raw, path)


def write(state_dir: str, verdicts: HealthVerdicts) -> None:
    """Replace health.json (atomically: a reader sees the old or the new verdicts). OSError is the caller's."""
    make_dirs(state_dir)  # 0755 whatever the umask (the agent checked it at its start: linux/trusteddir)
    atomicfile.replace(health_path(state_dir), jsonlite.dumps(verdicts.to_json(), sort_keys=True).encode(), 0o644)
