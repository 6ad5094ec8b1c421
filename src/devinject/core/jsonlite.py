"""JSON for the hook's start path without importing `json`.

`json` imports `re` and `enum` (~5 ms of a container start); the C scanner and encoder behind it
(`_json`) do not. Same output as `json.dumps(obj, sort_keys=...)` with default separators, same values as
`json.loads`, except that NaN and Infinity are refused. Falls back to `json` where `_json` is missing.
"""

from __future__ import annotations

try:
    import _json
except ImportError:  # pragma: no cover - CPython always has it
    _json = None  # type: ignore[assignment]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_WHITESPACE = " \t\n\r"


class _Context:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")


def _refuse(obj: object) -> Any:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


if _json is not None:
    _scan = _json.make_scanner(_Context())  # type: ignore[arg-type]  # duck-typed context, as json's
    _encoders = {
        flag: _json.make_encoder(None, _refuse, _json.encode_basestring_ascii, None, ": ", ", ", flag, False, False)
        for flag in (False, True)
    }


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def loads(data: str | bytes) -> Any:
    """Parse one JSON document; ValueError (or UnicodeDecodeError) when it is not one."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    if _json is None:
        import json

        return json.loads(text)
    start = _skip(text, 0)
    try:
        value, end = _scan(text, start)
    except StopIteration as stop:
        raise ValueError(f"Expecting value: char {stop.value}") from None
    except Exception:  # the C scanner's own error reporting wants `json`: let it say what is wrong
        import json

        return json.loads(text, parse_constant=_Context.parse_constant)
    end = _skip(text, end)
    if end != len(text):
        raise ValueError(f"Extra data: char {end}")
    return value


def replace_file(path: str, obj: object, *, sort_keys: bool = False) -> None:
    """Write `obj` to `path` through a temp file and a rename: readers see the old or the new file, never half.

    OSError is the caller's to handle.
    """
    from devinject.core.atomicfile import replace

    replace(path, dumps(obj, sort_keys=sort_keys).encode())


def dumps(obj: object, *, sort_keys: bool = False) -> str:
    if _json is None:
        import json

        return json.dumps(obj, sort_keys=sort_keys)
    return "".join(_encoders[sort_keys](obj, 0))
