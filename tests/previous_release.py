"""The previous release, which upgrades start from and rollbacks return to: v0.1.0. CI's clone may lack the
tag (a shallow or tag-less checkout), so its commit is named here, once; a clone without that commit fails
the tests that need it, saying how to fetch it (no network is assumed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

RELEASE = "v0.1.0"
RELEASE_VERSION = "0.1.0"
RELEASE_COMMIT = "4375c0383df68b43b9859f0821efb292d8326a2e"  # the tag v0.1.0
REPO = Path(__file__).resolve().parents[1]


def extract(out: Path, *paths: str) -> Path:
    """The release's `paths` (its `git archive`) under `out`, which is returned."""
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{RELEASE_COMMIT}^{{commit}}"],
                          capture_output=True, timeout=30)
    if have.returncode != 0:
        pytest.fail(f"{RELEASE} (commit {RELEASE_COMMIT}) is not in this clone: fetch it (`git fetch origin "
                    f"{RELEASE_COMMIT}`, or a clone with full history) to test against the previous release",
                    pytrace=False)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", RELEASE_COMMIT, *paths], capture_output=True,
                             check=True, timeout=120).stdout
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True, timeout=120)
    return out


def commit_time() -> int:
    """The release commit's time (SOURCE_DATE_EPOCH of its image, as its own `make image` would stamp)."""
    return int(subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct", RELEASE_COMMIT],
                              capture_output=True, text=True, check=True, timeout=30).stdout.strip())
