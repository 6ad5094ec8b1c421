#!/usr/bin/env python3
"""Print the mutation score of a finished `mutmut run` (run from its directory; `make mutation` does).

Per module: mutants caught (a test failed, hung or the type checker refused), missed (tests passed, or no
test reached the mutant) and not run; the score is caught / (caught + missed). Prints figures; asserts
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from mutmut.stats import status_by_exit_code  # mutmut's own reading of its exit codes

CAUGHT = {"killed", "timeout", "caught by type check", "segfault"}  # a test (or the checker) noticed
MISSED = {"survived", "no tests"}  # the tests passed, or none reached the mutant


def main() -> None:
    rows = []
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        statuses = [status_by_exit_code[c] for c in json.loads(meta.read_text())["exit_code_by_key"].values()]
        killed = sum(1 for s in statuses if s in CAUGHT)
        survived = sum(1 for s in statuses if s in MISSED)
        unchecked = len(statuses) - killed - survived
        rows.append((meta.name.removesuffix(".meta"), len(statuses), killed, survived, unchecked))
    print(f"{'module':<16}{'mutants':>9}{'killed':>8}{'survived':>10}{'not run':>9}{'score':>8}")
    for name, total, killed, survived, unchecked in rows:
        score = 100 * killed / (killed + survived) if killed + survived else 0.0
        print(f"{name:<16}{total:>9}{killed:>8}{survived:>10}{unchecked:>9}{score:>7.1f}%")
    total_killed = sum(r[2] for r in rows)
    total_survived = sum(r[3] for r in rows)
    total = sum(r[1] for r in rows)
    print(f"{'all':<16}{total:>9}{total_killed:>8}{total_survived:>10}{sum(r[4] for r in rows):>9}"
          f"{100 * total_killed / max(total_killed + total_survived, 1):>7.1f}%")


if __name__ == "__main__":
    main()
