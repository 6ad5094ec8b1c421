"""CDI names: `vendor/class=name`, with the character rules of CDI's parser (pkg/parser)."""

from __future__ import annotations

import re
from typing import NamedTuple

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


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
    if not _VENDOR_OR_CLASS.match(value):
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
    if not _DEVICE.match(name):
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
