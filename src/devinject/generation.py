"""Spec generations: every rewrite of a spec dir carries a number from one counter in the state dir, and a
writer never replaces a spec that carries a newer number. Two agents, or an agent and a manual
`generate`, therefore cannot roll the node back."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from devinject.filelock import exclusive
from devinject.spec import read_generation, write_atomic

COUNTER = "generation"
LOCK = "generation.lock"
LOCK_TIMEOUT = 30.0


def _locked(state_dir: str) -> contextlib.AbstractContextManager[None]:
    return exclusive(os.path.join(state_dir, LOCK), timeout=LOCK_TIMEOUT, what="spec generation")


def current(state_dir: str) -> int:
    try:
        return int(Path(state_dir, COUNTER).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _strip_header(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# devinject-generation:"))


def write_specs_generation(state_dir: str, files: dict[Path, str], stale: list[Path] | None = None) -> int | None:
    """Write `files` (path -> spec text without a header) under one new generation; remove `stale` files.

    Files whose content is unchanged are left alone (byte-identical reruns). Returns the generation
    written, or None when nothing changed. A file already carrying a newer generation is not replaced.
    """
    with _locked(state_dir):
        changed = {}
        for path, text in files.items():
            try:
                existing = path.read_text()
            except (OSError, UnicodeDecodeError):
                existing = None
            if existing is None or _strip_header(existing) != _strip_header(text):
                changed[path] = existing
        doomed = [p for p in stale or [] if p.exists()]
        if not changed and not doomed:
            return None
        generation = current(state_dir) + 1
        for path, existing in changed.items():
            theirs = read_generation(existing) if existing is not None else None
            if theirs is not None and theirs >= generation:
                continue  # someone wrote a newer generation than ours: never roll back
            header, _, body = files[path].partition("\n")
            write_atomic(path, f"{header}\n# devinject-generation: {generation}\n{body}")
        for path in doomed:
            theirs = read_generation(path.read_text())
            if theirs is None or theirs < generation:
                path.unlink()
        write_atomic(Path(state_dir, COUNTER), f"{generation}\n")
        return generation
