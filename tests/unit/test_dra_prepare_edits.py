"""A claim's spec is built from the driver's files as the driver read them for the claim before (specs/generate.py
EditsMemo): prepare read the driver's libraries, files and links again for every claim, ~2.5 of its ~5 ms
(bench/bench_dra.py). They are read again at a rescan, and at once when the linker cache's file changes (a
driver's install or upgrade runs ldconfig), and a claim's spec is the same as one built from a fresh read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import devinject.specs.generate as generate_module
from devinject.dra.driver import DraDriver, DraOptions
from devinject.specs.generate import GenerateOptions
from tests.integration.test_dra_driver import GPU_POOL, NODE, FakeApi

GPUS = ("gpu-0000-18-00-0", "gpu-0000-2a-00-0", "gpu-0000-3a-00-0")
UIDS = tuple(f"0b7f8e7c-3333-4c1b-9a55-00000000000{n}" for n in range(len(GPUS)))
OPENCL = "libnvidia-opencl.so.550.54.14"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of a kind's spec-level edits (the driver's files) from the host, by profile."""
    calls: list[str] = []
    real = generate_module.driver_edits

    def counted(view, profile, sources):  # type: ignore[no-untyped-def]
        calls.append(profile.name)
        return real(view, profile, sources)

    monkeypatch.setattr(generate_module, "driver_edits", counted)
    return calls


@pytest.fixture
def cache_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of the linker cache the driver's libraries are found by, by the root it was read under."""
    calls: list[str] = []
    real = generate_module.read_ldcache

    def counted(host):  # type: ignore[no-untyped-def]
        calls.append(host.root)
        return real(host)

    monkeypatch.setattr(generate_module, "read_ldcache", counted)
    return calls


def _driver(root: Path, base: Path) -> tuple[DraDriver, FakeApi]:
    dirs = {name: str(base / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    api = FakeApi()
    for n, (gpu, uid) in enumerate(zip(GPUS, UIDS, strict=True)):
        api.add(f"claim-{n}", uid, [(GPU_POOL, gpu)])
    opts = DraOptions(generate=GenerateOptions(root=str(root), hook_path="/usr/bin/devinject"), node_name=NODE,
                      plugin_dir=dirs["plugins"], registry_dir=dirs["registry"], cdi_dir=dirs["cdi"],
                      state_dir=dirs["state"], rescan=3600)
    return DraDriver(opts, api), api


def _prepare(driver: DraDriver, n: int) -> dict[str, object]:
    driver.preparer.prepare("default", f"claim-{n}", UIDS[n])
    spec: dict[str, object] = json.loads(Path(driver.preparer.spec_path(UIDS[n])).read_text())
    return spec


def _host_paths(spec: dict[str, object]) -> set[str]:
    edits = spec["containerEdits"]
    assert isinstance(edits, dict)
    return {m["hostPath"] for m in edits.get("mounts", [])}


def test_claims_after_the_first_read_no_driver_file_and_get_the_spec_a_fresh_read_gives(
        host_copy, tmp_path: Path, reads: list[str], cache_reads: list[str]) -> None:  # type: ignore[no-untyped-def]
    root = host_copy("hgx-h100")
    driver, _ = _driver(root, tmp_path / "one")
    specs = [_prepare(driver, n) for n in range(len(GPUS))]
    assert reads == ["nvidia-gpu"]  # once, for the first claim
    assert len(cache_reads) == 1, cache_reads  # and the linker cache with them
    for n, spec in enumerate(specs):  # each as a driver that never built a spec before builds it
        fresh, _ = _driver(root, tmp_path / f"fresh-{n}")
        assert _prepare(fresh, n) == spec
    assert any(p.endswith(OPENCL) for p in _host_paths(specs[-1])), "the fixture's driver libraries are mounted"


def test_a_rescan_reads_the_driver_files_again(host_copy, tmp_path: Path,  # type: ignore[no-untyped-def]
                                               reads: list[str]) -> None:
    driver, _ = _driver(host_copy("hgx-h100"), tmp_path)
    _prepare(driver, 0)
    driver.refresh()
    _prepare(driver, 1)
    assert reads == ["nvidia-gpu", "nvidia-gpu"]


def test_a_new_linker_cache_is_read_at_the_next_claim_not_the_next_rescan(
        host_copy, tmp_path: Path, reads: list[str],  # type: ignore[no-untyped-def]
        cache_reads: list[str]) -> None:
    """A driver's files change (a library removed, as an upgrade or uninstall does) and ldconfig writes the
    host's linker cache again: the next claim's spec has the files as they are now, with no rescan between."""
    need = shutil.which("ldconfig") or "/sbin/ldconfig"
    root = host_copy("hgx-h100")
    driver, _ = _driver(root, tmp_path)
    assert any(p.endswith(OPENCL) for p in _host_paths(_prepare(driver, 0)))
    for library in (root / "usr/lib/x86_64-linux-gnu").glob("libnvidia-opencl.so*"):
        library.unlink()
    subprocess.run([need, "-X", "-r", str(root)], check=True, capture_output=True, timeout=60)
    after = _host_paths(_prepare(driver, 1))
    assert reads == ["nvidia-gpu", "nvidia-gpu"]
    assert len(cache_reads) == 2, cache_reads  # the new cache read for the claim after ldconfig
    assert not [p for p in after if "libnvidia-opencl" in p], sorted(after)
    assert any(p.endswith("libcuda.so.550.54.14") for p in after), sorted(after)
