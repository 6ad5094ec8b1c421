"""CDI names: `vendor/class=name`, with the character rules of CDI's parser (pkg/parser)."""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.records import NamedTuple

# Plain character sets, not regexes: the hook checks every requested name and compiling patterns
# would cost it a millisecond on every container start.
_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ALNUM = _LETTERS | frozenset("0123456789")
_SEGMENT_MIDDLE = _ALNUM | frozenset("_.-")
_DEVICE_MIDDLE = _SEGMENT_MIDDLE | frozenset(":")


def _shaped(value: str, first: frozenset[str], middle: frozenset[str]) -> bool:
    """`first`, then any of `middle`, ending alphanumeric (a single character needs only `first`)."""
    if not value or value[0] not in first:
        return False
    return len(value) == 1 or (value[-1] in _ALNUM and all(ch in middle for ch in value[1:-1]))


class QualifiedName(NamedTuple):
    vendor: str
    device_class: str
    name: str

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.device_class}"

    def __str__(self) -> str:
        return f"{self.vendor}/{self.device_class}={self.name}"


def _segment_problem(what: str, value: str) -> str | None:
    if not _shaped(value, _LETTERS, _SEGMENT_MIDDLE):
        return f"invalid {what} {value!r}: letters, digits, '_', '-', '.'; start with a letter, end alphanumeric"
    return None


def vendor_problem(vendor: str) -> str | None:
    return _segment_problem("vendor", vendor)


def class_problem(device_class: str) -> str | None:
    return _segment_problem("class", device_class)


def kind_problem(kind: str) -> str | None:
    vendor, sep, device_class = kind.partition("/")
    if not sep:
        return f"invalid kind {kind!r}: expected vendor/class"
    return vendor_problem(vendor) or class_problem(device_class)


def device_name_problem(name: str) -> str | None:
    if not _shaped(name, _ALNUM, _DEVICE_MIDDLE):
        return (
            f"invalid device name {name!r}: letters, digits, '_', '-', '.', ':'; "
            "start and end alphanumeric"
        )
    return None


def parse_qualified_name(text: str) -> QualifiedName:
    """Parse `vendor/class=name`; raises ValueError with a reason."""
    kind, sep, name = text.strip().partition("=")
    if not sep or not name:
        raise ValueError(f"invalid device {text!r}: expected vendor/class=name")
    problem = kind_problem(kind) or device_name_problem(name)
    if problem:
        raise ValueError(f"invalid device {text!r}: {problem}")
    vendor, _, device_class = kind.partition("/")
    return QualifiedName(vendor, device_class, name)
