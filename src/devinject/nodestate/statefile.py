"""The one reader rule of the node's state files: read whole (up to a size cap), parsed as JSON, checked field by
field against its owner's record, and any failure one line naming the file and the field (`StateFileError`).
Every file in the state dir has one owner module in `nodestate/` with a record (`from_json`/`to_json`, a
`version`); what a caller does with a file that fails is its owner's decision, written there once
(docs/lifecycle.md, "State files").

Kept lean as every module the hook imports: no `typing` or `json` at run time (core/jsonlite parses).
"""

from __future__ import annotations

from devinject.core import jsonlite
from devinject.core.errors import DevinjectError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

MAX_BYTES = 8 << 20  # no state file is near this; a larger one is not devinject's


class StateFileError(DevinjectError):
    """A state file that cannot be read or is not what its owner writes; the message names the file and the
    field (`<path>.devices['k'].published: expected one of ...`)."""


class UnreadableStateFile(StateFileError):
    """The file is there but cannot be read (permissions, I/O): not a sign it is corrupt."""


def read_bytes(path: str, *, what: str = "it", max_bytes: int = MAX_BYTES) -> bytes | None:
    """The whole of `path`; None when there is no such file. UnreadableStateFile for one that cannot be read,
    StateFileError for one larger than `max_bytes` (never taken into memory whole)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UnreadableStateFile(f"{path}: cannot read {what}: {err.strerror}") from None
    if len(data) > max_bytes:
        raise StateFileError(f"{path}: larger than {max_bytes} bytes")
    return data


def read_document(path: str, *, what: str = "it", max_bytes: int = MAX_BYTES) -> object | None:
    """The parsed JSON of `path`; None when there is no such file. StateFileError for one that cannot be
    read, is larger than `max_bytes`, or is not one JSON document (a truncated file is not)."""
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    return None if data is None else parse_document(data, path)


def parse_document(data: bytes, path: str) -> object:
    try:
        return jsonlite.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise StateFileError(f"{path}: not JSON ({err})") from None


def problem_in(err: StateFileError, path: str) -> str:
    """What `err` says is wrong, less the file's name it starts with (`unhealthy_nodes: expected ...`), for
    an owner's message that names the file once."""
    said = err.message
    return said[len(path):].lstrip(".: ") if said.startswith(path) else said


def need_object(value: object, at: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise StateFileError(f"{at}: expected an object")
    return value


def need_str(value: object, at: str) -> str:
    if not isinstance(value, str):
        raise StateFileError(f"{at}: expected a string")
    return value


def need_int(value: object, at: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StateFileError(f"{at}: expected an integer")
    return value


def need_number(value: object, at: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise StateFileError(f"{at}: expected a number")
    return float(value)


def need_strings(value: object, at: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise StateFileError(f"{at}: expected a list of strings")
    return tuple(need_str(item, f"{at}[{i}]") for i, item in enumerate(value))


def need_version(raw: Mapping[str, object], path: str, readable: tuple[int, ...], *, absent: int | None = 1) -> int:
    """The file's format `version`, one of `readable` (`absent`: what a file without one is, one written before
    versions; None: a version is required). StateFileError for any other (a newer devinject's, after a
    downgrade: its owner decides what then)."""
    version = raw.get("version", absent)
    if not isinstance(version, int) or isinstance(version, bool) or version not in readable:
        known = ", ".join(str(v) for v in readable)
        raise StateFileError(f"{path}.version: {version!r} is not a version this devinject reads ({known})")
    return version
