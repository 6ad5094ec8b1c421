"""JSON for devinject's files and messages: the standard library's `json`, imported when first used.

Not at import time: the hook's modules import this one on every container start the hook runs in-process
(and every `cdi-hook`), and `json` pulls in `re` and `enum` (~5 ms). The hook installs a codec of its own
instead (hook/fastjson.py, `install`): the one place that reaches into CPython's private `_json`, measured by
bench/bench_hook_imports.py. Both codecs give the same text and values; NaN and Infinity are refused both
ways, as JSON has no such values (a number out of a double's range too, which would parse as inf).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def finite_float(text: str) -> float:
    """A JSON number as a float; ValueError for one out of a double's range (`1e400` is no inf here)."""
    value = float(text)
    if value - value != 0:  # inf (or nan): inf - inf is nan, and nan != 0
        raise ValueError(f"number {text} is out of range")
    return value


def stdlib_loads(text: str) -> Any:
    import json

    return json.loads(text, parse_constant=_refuse_constant, parse_float=finite_float)


def stdlib_dumps(obj: object, sort_keys: bool) -> str:
    import json

    return json.dumps(obj, sort_keys=sort_keys, allow_nan=False)


_loads: Callable[[str], Any] = stdlib_loads
_dumps: Callable[[object, bool], str] = stdlib_dumps


def install(loads: Callable[[str], Any], dumps: Callable[[object, bool], str]) -> None:
    """Use another codec from now on, in this process (the hook's import-free one)."""
    global _loads, _dumps
    _loads, _dumps = loads, dumps


def loads(data: str | bytes) -> Any:
    """Parse one JSON document; ValueError (or UnicodeDecodeError) when it is not one."""
    return _loads(data.decode("utf-8") if isinstance(data, bytes) else data)


def dumps(obj: object, *, sort_keys: bool = False) -> str:
    """`json.dumps(obj, sort_keys=...)` with the default separators; TypeError for what JSON cannot hold,
    ValueError for NaN and Infinity."""
    return _dumps(obj, sort_keys)


def replace_file(path: str, obj: object, *, sort_keys: bool = False) -> None:
    """Write `obj` to `path` through a temp file and a rename: readers see the old or the new file, never half.

    OSError is the caller's to handle.
    """
    from devinject.core.atomicfile import replace

    replace(path, dumps(obj, sort_keys=sort_keys).encode())
