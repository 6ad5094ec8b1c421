"""Parsers for the procfs text files discovery reads. Pure functions over strings."""

from __future__ import annotations

import re


def parse_proc_devices(text: str) -> dict[str, int]:
    """`/proc/devices` character section: region name -> major (a major may carry several names)."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices:"):
            in_char = True
            continue
        if line.startswith("Block devices:"):
            break
        fields = line.split(None, 1)
        if in_char and len(fields) == 2 and fields[0].isdigit():
            majors.setdefault(fields[1].strip(), int(fields[0]))
    # Drivers before 550 registered one region "nvidia-frontend" for what is now "nvidia".
    if "nvidia-frontend" in majors and "nvidia" not in majors:
        majors["nvidia"] = majors["nvidia-frontend"]
    return majors


def _pairs(text: str, separator: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(separator)
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_key_values(text: str) -> dict[str, str]:
    """`Key: value` lines split on the first colon (NVIDIA's `information` file, tab-padded)."""
    return _pairs(text, ":")


_NVRM_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")


def parse_nvidia_version(text: str) -> str | None:
    """Driver version from `/proc/driver/nvidia/version` (proprietary or open kernel module)."""
    match = _NVRM_VERSION.search(text)
    return match.group(1) if match else None


def parse_uevent(text: str) -> dict[str, str]:
    """A sysfs `uevent` file: `KEY=value` lines."""
    return _pairs(text, "=")


def parse_dev_numbers(text: str) -> tuple[int, int] | None:
    """A sysfs `dev` attribute, `MAJ:MIN\\n`."""
    major, sep, minor = text.strip().partition(":")
    if not sep or not major.isdigit() or not minor.isdigit():
        return None
    return int(major), int(minor)
