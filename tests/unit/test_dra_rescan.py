"""The DRA driver rescans as `watch` does (discovery/node.py `Node.rescanned`): the profiles are loaded once,
when the driver is made, and each rescan reads the host again with them. The driver made a Node (and so
loaded every profile file again) on every rescan, and its health loop loaded them once more."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

import devinject.discovery.node as node_module
from devinject.dra.driver import DraDriver, DraOptions
from devinject.specs.generate import GenerateOptions
from tests.integration.test_dra_driver import NODE, FakeApi

dirs = __import__("tests.integration.test_dra_driver", fromlist=["dirs"]).dirs


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every load of the profiles (by the root it read them under)."""
    calls: list[str] = []
    real = node_module.load_profiles

    def counted(host, profile_dirs):  # type: ignore[no-untyped-def]
        calls.append(host.root)
        return real(host, profile_dirs)

    monkeypatch.setattr(node_module, "load_profiles", counted)
    return calls


def _driver(root: Path, dirs: dict[str, str]) -> DraDriver:
    gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject")
    opts = DraOptions(generate=gen, node_name=NODE, plugin_dir=dirs["plugins"], registry_dir=dirs["registry"],
                      cdi_dir=dirs["cdi"], state_dir=dirs["state"], rescan=3600)
    return DraDriver(opts, FakeApi())


def test_profiles_are_loaded_once_across_rescans_and_the_health_loop(
        host_copy, dirs: dict[str, str], loads: list[str]) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("hgx-h100")
    driver = _driver(root, dirs)
    for _ in range(3):
        driver.refresh()
    stop = threading.Event()
    try:
        assert driver.start_health_loop(stop)
        assert driver.loop is not None and driver.loop.profiles
    finally:
        stop.set()
        driver._stop_health_loop()
    driver.refresh()
    assert loads == [str(root)]


def test_each_rescan_reads_the_host_again(host_copy, dirs: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("hgx-h100")
    driver = _driver(root, dirs)
    before = {o.device.address for o in driver.discover().offers.values() if o.kind == "nvidia.com/gpu"}
    gone = sorted(before)[-1]
    for link in (root / "sys/bus/pci/devices").glob(gone):
        target = link.resolve()
        link.unlink()
        shutil.rmtree(target)
    after = {o.device.address for o in driver.discover().offers.values() if o.kind == "nvidia.com/gpu"}
    assert after == before - {gone}
