"""Effects applied one by one, each pushing its undo: a failure unwinds exactly what was done, in reverse
(dra/claims.py's prepare)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Effect:
    """One change to the node: `name` says what (for the log, and the tests that fail after each), `do`
    makes it, `undo` takes it back."""

    name: str
    do: Callable[[], object]
    undo: Callable[[], object]


def nothing() -> None:
    """The undo of an effect that stays (a setting another holder may have set the same way)."""


def apply_all(effects: list[Effect]) -> None:
    """Each effect done in order; when one fails (a bug too), the ones done are undone in reverse and the
    failure raised. An undo that fails is logged and the others still run: what can be taken back is."""
    done: list[Effect] = []
    try:
        for effect in effects:
            effect.do()
            done.append(effect)
    except BaseException:
        unwind(done)
        raise


def unwind(done: list[Effect]) -> None:
    for effect in reversed(done):
        try:
            effect.undo()
        except Exception as err:  # every other undo still runs; this one is named
            log.warning("could not undo %s: %s", effect.name, getattr(err, "message", err))
