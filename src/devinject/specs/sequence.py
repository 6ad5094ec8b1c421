"""Spec generations for the spec directories `watch` manages: every rewrite carries a number from the
directory's own counter (`.devinject-generation`, beside the specs; CDI runtimes read only *.yaml/*.json),
and a writer never replaces a spec that carries a newer number. Two agents, or an agent and a manual
`generate` into its directory, therefore cannot roll the node back.

A directory without the counter is not managed: `generate` writes there as a pure function of the host,
the same bytes on every run."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from devinject.cdi.spec import read_generation, write_atomic
from devinject.linux.filelock import exclusive

COUNTER = ".devinject-generation"
LOCK = ".devinject-generation.lock"
LOCK_TIMEOUT = 30.0


def _locked(directory: Path) -> contextlib.AbstractContextManager[None]:
    return exclusive(os.path.join(directory, LOCK), timeout=LOCK_TIMEOUT, what="spec generation")


def managed(directory: Path) -> bool:
    """Whether `watch` manages this spec directory (it carries a generation counter)."""
    return Path(directory, COUNTER).is_file()


def current(directory: Path) -> int:
    try:
        return int(Path(directory, COUNTER).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _strip_header(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# devinject-generation:"))


def write_specs_generation(directory: Path, files: dict[Path, str], stale: list[Path] | None = None) -> int | None:
    """Write `files` (path -> spec text without a header) in `directory` under one new generation (the
    directory becomes managed); remove `stale` files.

    Files whose content is unchanged are left alone (byte-identical reruns). Returns the generation
    written, or None when nothing changed. A file already carrying a newer generation is not replaced.
    """
    with _locked(directory):
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
            if not managed(directory):
                write_atomic(Path(directory, COUNTER), f"{current(directory)}\n")
            return None
        generation = current(directory) + 1
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
        write_atomic(Path(directory, COUNTER), f"{generation}\n")
        return generation
