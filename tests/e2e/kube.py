"""What the live tests on real Kubernetes share: where ../shared/kube's scripts are, a prerequisite that fails
(never skips), and a bounded wait."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.e2e.conftest import REPO

# the cluster's scripts (their README): where DEVINJECT_KUBE points, beside the checkout, or the machine's own
KUBE = next((p for p in (Path(os.environ.get("DEVINJECT_KUBE", REPO.parent / "shared" / "kube")),
                         REPO.parent / "shared" / "kube", Path("/work/shared/kube")) if (p / "cluster-up.sh").exists()),
            REPO.parent / "shared" / "kube")
T = TypeVar("T")


def need(condition: object, reason: str) -> None:
    """A prerequisite: missing, the test fails (CI must never pass by skipping the cluster)."""
    if not condition:
        pytest.fail(f"live test prerequisite missing: {reason}", pytrace=False)


def until(condition: Callable[[], T | None], timeout: float, what: str, every: float = 0.2) -> T:
    """`condition()`'s first truthy value, polled every `every` s; an AssertionError naming `what` after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
