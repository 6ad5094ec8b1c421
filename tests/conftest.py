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
# Hosts described as data (fixtures/topologies/*.yaml), built on demand by fixtures/pcie_hosts.py
TOPOLOGY_HOSTS = sorted(p.stem for p in (FIXTURES / "topologies").glob("*.yaml"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite golden specs from current output")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def topology_hosts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every topology host, built once per session: `topology_hosts / name` is its root."""
    from tests.fixtures.pcie_hosts import build_topology_host

    base = tmp_path_factory.mktemp("topology-hosts")
    for name in TOPOLOGY_HOSTS:
        build_topology_host(name, base / name)
    return base


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


@pytest.fixture(scope="session")
def nvml_stubs(tmp_path_factory: pytest.TempPathFactory):
    """Stub libnvidia-ml.so.1 builds (tests/nvmlstub), one per fixture host and variant, compiled once a
    session: `nvml_stubs("hgx-h100", hang=..., omit=...)` is the library's path."""
    from tests.e2e.conftest import require
    from tests.nvmlstub import build_stub

    require(shutil.which("gcc") is not None, "gcc not installed: the stub libnvidia-ml is compiled (make system-deps)")
    base = tmp_path_factory.mktemp("nvml-stubs")
    built: dict[tuple[str, str | None, tuple[str, ...]], Path] = {}

    def build(host: str, *, hang: str | None = None, omit: tuple[str, ...] = ()) -> Path:
        key = (host, hang, tuple(sorted(omit)))
        if key not in built:
            built[key] = build_stub(base / f"stub{len(built)}", HOSTS / host, hang=hang, omit=omit)
        return built[key]

    return build


@pytest.fixture
def nvml_host(host_copy, nvml_stubs):
    """A copy of a fixture host whose libnvidia-ml is the stub built from its data (variant as nvml_stubs)."""
    from tests.nvmlstub import install_stub

    def make(name: str, **variant: object) -> Path:
        root = host_copy(name)
        install_stub(root, nvml_stubs(name, **variant))
        return root

    return make
