"""Digits, names and keys in what others write (a pod user's claim config or image, an API server's header)
are ASCII: `str.isdigit` also takes '²' (which int() then refuses: a ValueError no handler expected) and '٣'
(which int() reads as 3), and a regex's `\\d` without re.ASCII takes both. Lean: the hook uses it."""

from __future__ import annotations


def is_digits(text: str) -> bool:
    """`text` is one or more of 0-9 and nothing else."""
    return text.isascii() and text.isdigit()
