"""Device events: JSON lines in the state dir plus a per-device ring of the last transitions."""

from __future__ import annotations

import os
import time

from devinject import jsonlite

TYPE_CHECKING = False  # the hook records ledger events: `typing` stays off its start path
if TYPE_CHECKING:
    from typing import Any

EVENTS_FILE = "events.jsonl"
RING_FILE = "device-events.json"
RING_SIZE = 20


def record(state_dir: str, event: str, device: str | None = None, **fields: Any) -> dict[str, Any]:
    entry = {"time": round(time.time(), 3), "event": event, **({"device": device} if device else {}), **fields}
    os.makedirs(state_dir, exist_ok=True)
    with open(os.path.join(state_dir, EVENTS_FILE), "a", encoding="utf-8") as handle:
        handle.write(jsonlite.dumps(entry, sort_keys=True) + "\n")
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
