"""The hook's JSON codec: CPython's C scanner and encoder (`_json`) without the `json` package.

`json` imports `re` and `enum`, ~5 ms of every container start the hook runs in-process and of every
`cdi-hook` (bench/bench_hook_imports.py); `_json` is built into the interpreter and imports nothing. This is
private CPython API, so it is kept here, in the hook, and nowhere else: `install()` puts it behind
core/jsonlite.py for this process. Same text as `json.dumps(obj, sort_keys=...)` with the default
separators, same values as `json.loads`; NaN and Infinity refused, as core/jsonlite's standard codec refuses
them. Where `_json` is missing (not CPython) the standard codec stays.
"""

from __future__ import annotations

from devinject.core import jsonlite

try:
    import _json
except ImportError:  # pragma: no cover - CPython always has it
    _json = None  # type: ignore[assignment]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_WHITESPACE = " \t\n\r"


class _Context:
    """What `_json.make_scanner` reads from a `json.JSONDecoder`: duck-typed, as `json.scanner` does."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = staticmethod(jsonlite.finite_float)  # a number out of range is no inf
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")


def _refuse(obj: object) -> Any:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


if _json is not None:
    _scan = _json.make_scanner(_Context())  # type: ignore[arg-type]  # duck-typed context, as json's


def _encoder(sort_keys: bool) -> Any:
    """The C encoder as json.dumps makes it; a fresh `markers` dict per call, so a circular structure is a
    ValueError (as json's), not a RecursionError."""
    return _json.make_encoder({}, _refuse, _json.encode_basestring_ascii, None, ": ", ", ", sort_keys, False, False)


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def loads(text: str) -> Any:
    start = _skip(text, 0)
    try:
        value, end = _scan(text, start)
    except StopIteration as stop:
        raise ValueError(f"Expecting value: char {stop.value}") from None
    except Exception:  # the C scanner's own error reporting wants `json`: let the standard codec say what
        return jsonlite.stdlib_loads(text)
    end = _skip(text, end)
    if end != len(text):
        raise ValueError(f"Extra data: char {end}")
    return value


def dumps(obj: object, sort_keys: bool) -> str:
    return "".join(_encoder(sort_keys)(obj, 0))


def install() -> None:
    if _json is not None:
        jsonlite.install(loads, dumps)
