"""Device events: JSON lines in the state dir plus a per-device ring of the last transitions. The state dir
is checked (root's alone) and created 0755, events.jsonl appended to 0644 without following a link, the
ring replaced 0644 (core/atomicfile): whatever the caller's umask.

The ring (`DeviceEvents`, device-events.json) has one reader, `read_ring`: a file that fails is a StateFileError
naming the file and the field for `events` (what it shows must not be a guess), and is replaced by one holding
the new event when the next is recorded (it is recent history; events.jsonl keeps every event)."""

from __future__ import annotations

import os
import time

from devinject.core import jsonlite
from devinject.linux.trusteddir import append, trusted_dir
from devinject.nodestate.statefile import StateFileError, need_object, need_version, read_document

TYPE_CHECKING = False  # the hook records ledger events: `typing` stays off its start path
if TYPE_CHECKING:
    from typing import Any, NamedTuple
else:
    from devinject.core.records import NamedTuple

EVENTS_FILE = "events.jsonl"
RING_FILE = "device-events.json"
RING_SIZE = 20
RING_VERSION = 1  # version 1 as written before it had a version: the devices' rings at the top level
MAX_EVENTS_BYTES = 1 << 20  # then events.jsonl becomes events.jsonl.1 (replacing the older one): /run is RAM


class DeviceEvents(NamedTuple):
    """device-events.json: each device's last RING_SIZE events (by its key), oldest first."""
    rings: dict[str, list[dict[str, object]]]
    version: int = RING_VERSION

    def to_json(self) -> dict[str, object]:
        return {"version": self.version, "devices": self.rings}

    @classmethod
    def from_json(cls, raw: object, path: str) -> DeviceEvents:
        data = need_object(raw, path)
        legacy = "devices" not in data and "version" not in data  # before versions: the rings alone
        version = need_version(data, path, (RING_VERSION,))
        rings = data if legacy else need_object(data.get("devices"), f"{path}.devices")
        out: dict[str, list[dict[str, object]]] = {}
        for device, entries in rings.items():
            at = f"{path}.devices[{device!r}]"
            if not isinstance(entries, list):
                raise StateFileError(f"{at}: expected a list of events")
            out[str(device)] = [need_object(entry, f"{at}[{i}]") for i, entry in enumerate(entries)]
        return cls(out, version)


def read_ring(state_dir: str) -> DeviceEvents:
    """The rings; none when no event named a device yet. StateFileError naming the file and the field."""
    path = os.path.join(state_dir, RING_FILE)
    raw = read_document(path)
    return DeviceEvents({}) if raw is None else DeviceEvents.from_json(raw, path)


def record(state_dir: str, event: str, device: str | None = None, **fields: Any) -> dict[str, Any]:
    entry = {"time": round(time.time(), 3), "event": event, **({"device": device} if device else {}), **fields}
    trusted_dir(state_dir)
    path = os.path.join(state_dir, EVENTS_FILE)
    line = (jsonlite.dumps(entry, sort_keys=True) + "\n").encode()
    if not append(path, line, max_size=MAX_EVENTS_BYTES):
        os.replace(path, path + ".1")
        append(path, line)
    if device:
        try:
            rings = read_ring(state_dir).rings
        except StateFileError:  # replaced: see the module's doc
            rings = {}
        rings[device] = ([*rings.get(device, []), entry])[-RING_SIZE:]
        jsonlite.replace_file(os.path.join(state_dir, RING_FILE), DeviceEvents(rings).to_json(), sort_keys=True)
    return entry


def device_history(state_dir: str, key: str | None = None) -> dict[str, list[dict[str, object]]]:
    """The rings of every device, or of the device filed under `key` (a name's keys: discovery/resolve.py).
    StateFileError for a ring file that fails."""
    rings = read_ring(state_dir).rings
    if key is None:
        return rings
    return {k: v for k, v in rings.items() if k == key}
