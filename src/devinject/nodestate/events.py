"""Device events: JSON lines in the state dir plus a per-device ring of the last transitions. The state dir
is checked (root's alone) and created 0755, events.jsonl appended to 0644 without following a link, the
ring replaced 0644 (core/atomicfile): whatever the caller's umask."""

from __future__ import annotations

import os
import time

from devinject.core import jsonlite
from devinject.core.trusteddir import append, trusted_dir

TYPE_CHECKING = False  # the hook records ledger events: `typing` stays off its start path
if TYPE_CHECKING:
    from typing import Any

EVENTS_FILE = "events.jsonl"
RING_FILE = "device-events.json"
RING_SIZE = 20
MAX_EVENTS_BYTES = 1 << 20  # then events.jsonl becomes events.jsonl.1 (replacing the older one): /run is RAM


def record(state_dir: str, event: str, device: str | None = None, **fields: Any) -> dict[str, Any]:
    entry = {"time": round(time.time(), 3), "event": event, **({"device": device} if device else {}), **fields}
    trusted_dir(state_dir)
    path = os.path.join(state_dir, EVENTS_FILE)
    line = (jsonlite.dumps(entry, sort_keys=True) + "\n").encode()
    if not append(path, line, max_size=MAX_EVENTS_BYTES):
        os.replace(path, path + ".1")
        append(path, line)
    if device:
        ring_path = os.path.join(state_dir, RING_FILE)
        try:
            with open(ring_path, encoding="utf-8") as handle:
                rings = jsonlite.loads(handle.read())
        except (OSError, ValueError):
            rings = {}
        rings[device] = ([*rings.get(device, []), entry])[-RING_SIZE:]
        jsonlite.replace_file(ring_path, rings, sort_keys=True)
    return entry


def device_history(state_dir: str, device: str | None = None) -> dict[str, list[dict[str, Any]]]:
    try:
        with open(os.path.join(state_dir, RING_FILE), encoding="utf-8") as handle:
            rings: dict[str, list[dict[str, Any]]] = jsonlite.loads(handle.read())
    except (OSError, ValueError):
        return {}
    if device is None:
        return rings
    return {k: v for k, v in rings.items() if k == device or k.endswith("=" + device) or device in k}
