"""CDI names: `vendor/class=name`, with the character rules of CDI's parser (pkg/parser)."""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

# Plain character sets, not regexes: the hook checks every requested name and compiling patterns
# would cost it a millisecond on every container start.
_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ALNUM = _LETTERS | frozenset("0123456789")
_SEGMENT_MIDDLE = _ALNUM | frozenset("_.-")
_DEVICE_MIDDLE = _SEGMENT_MIDDLE | frozenset(":")


def _shape_problem(what: str, value: str, first: frozenset[str], first_words: str, middle: frozenset[str],
                   middle_words: str) -> str | None:
    """Why `value` is not `first`, then any of `middle`, ending alphanumeric; in words, or None."""
    if not value:
        return f"the {what} is empty"
    if value[0] not in first:
        return f"the {what} must start with {first_words}"
    bad = next((ch for ch in value[1:-1] if ch not in middle), None)
    if bad is not None:
        return f"the {what} may contain only {middle_words} (not {bad!r})"
    if len(value) > 1 and value[-1] not in _ALNUM:
        return f"the {what} must end with a letter or digit"
    return None


class QualifiedName(NamedTuple):
    vendor: str
    device_class: str
    name: str

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.device_class}"

    def __str__(self) -> str:
        return f"{self.vendor}/{self.device_class}={self.name}"


_SEGMENT_WORDS = "letters, digits, '_', '.', '-'"


def vendor_problem(vendor: str) -> str | None:
    return _shape_problem("vendor", vendor, _LETTERS, "a letter", _SEGMENT_MIDDLE, _SEGMENT_WORDS)


def class_problem(device_class: str) -> str | None:
    return _shape_problem("class", device_class, _LETTERS, "a letter", _SEGMENT_MIDDLE, _SEGMENT_WORDS)


def kind_problem(kind: str) -> str | None:
    """`kind "vendor.com-/gpu": the vendor must end with a letter or digit`, or None."""
    vendor, sep, device_class = kind.partition("/")
    if not sep:
        return f"kind {kind!r}: expected vendor/class (like vendor.com/gpu)"
    problem = vendor_problem(vendor) or class_problem(device_class)
    return f"kind {kind!r}: {problem}" if problem else None


def device_name_problem(name: str) -> str | None:
    problem = _shape_problem("name", name, _ALNUM, "a letter or digit", _DEVICE_MIDDLE,
                             "letters, digits, '_', '.', '-', ':'")
    return f"device name {name!r}: {problem}" if problem else None


def parse_qualified_name(text: str) -> QualifiedName:
    """Parse `vendor/class=name`; raises ValueError with a reason."""
    kind, sep, name = text.strip().partition("=")
    if not sep or not name:
        raise ValueError(f"invalid device {text!r}: expected vendor/class=name")
    problem = kind_problem(kind) or device_name_problem(name)
    if problem:
        raise ValueError(f"invalid device {text!r}: {problem.split(': ', 1)[1]}")
    vendor, _, device_class = kind.partition("/")
    return QualifiedName(vendor, device_class, name)
