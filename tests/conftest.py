from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# The fixture trees are data (symlink-rich sysfs copies); a mutation run copies only the test code and
# points here with DEVINJECT_FIXTURES.
FIXTURES = Path(os.environ.get("DEVINJECT_FIXTURES") or Path(__file__).parent / "fixtures")
HOSTS = FIXTURES / "hosts"
GOLDEN = FIXTURES / "golden"
HOST_NAMES = sorted(p.name for p in HOSTS.iterdir() if p.is_dir())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite golden specs from current output")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture
def host_copy(tmp_path: Path):
    """Copy a fixture host into tmp_path so a test can break it."""

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(HOSTS / name, target, symlinks=True)
        return target

    return copy


@pytest.fixture
def v1_device_cgroup():  # type: ignore[no-untyped-def]
    """A scratch cgroup in the v1 devices hierarchy, removed after the test (once its processes are gone)."""
    import time
    import uuid

    from tests.e2e.conftest import require

    devices = Path("/sys/fs/cgroup/devices")
    require(os.geteuid() == 0 and (devices / "devices.allow").exists(), "needs root and cgroup v1 devices")
    group = devices / f"devinject-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    yield group
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.02)
