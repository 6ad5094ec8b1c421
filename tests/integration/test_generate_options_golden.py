"""Every spec `generate` writes for the fixture hosts under the main option combinations, byte for byte.

test_golden.py keeps the default options' specs as readable files; this keeps the digest of every spec (and
of every refusal) for each host under each kind alone and each option that changes a spec: the device-name
strategies, the CDI version cap, a target root, a driver root, the gpu-nic bundles, excluded devices, the
default hook command, JSON output. A change to any stage of the pipeline (discovery, rerooting, hooks, mount
options, versioning) shows up here as the case it changed. `--update-golden` rewrites the digests.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.cdi.identity import device_key
from devinject.core.errors import DevinjectError
from devinject.discovery.node import Node
from devinject.specs.generate import GenerateOptions, generate_specs, render, spec_filename
from tests.conftest import FIXTURES, HOST_NAMES, HOSTS

DIGESTS = FIXTURES / "golden-options.json"
HOOK = "/usr/bin/devinject"

OPTION_CASES: dict[str, dict[str, object]] = {
    "default": {},
    "strategies=index,uuid,pci": {"strategies": ("index", "uuid", "pci")},
    "strategies=uuid": {"strategies": ("uuid",)},
    "strategies=pci": {"strategies": ("pci",)},
    "cdi-version=0.5.0": {"version_cap": "0.5.0"},
    "cdi-version=0.7.0": {"version_cap": "0.7.0"},
    "target-root=/host": {"target_root": "/host"},
    "target-root=/": {"target_root": "/"},
    "bundles=gpu-nic": {"bundles": ("gpu-nic",)},
    "target-root=/host,strategies=index,uuid,pci,cdi-version=0.7.0": {
        "target_root": "/host", "strategies": ("index", "uuid", "pci"), "version_cap": "0.7.0"},
}


def _rendered(opts: GenerateOptions, root: str, fmt: str = "yaml") -> dict[str, str]:
    """Each spec's file name -> its text with the machine's own paths replaced; a refusal as its message."""
    try:
        specs = generate_specs(opts)
        texts = {spec_filename(s, fmt): render(s, fmt) for s in specs}
    except DevinjectError as err:
        texts = {"error": str(err)}
    launcher = str(Path(__file__).parents[2] / "src/devinject/hook/launcher.py")
    return {name: text.replace(root, "<ROOT>").replace(launcher, "<LAUNCHER>").replace(sys.executable, "<PYTHON>")
            for name, text in texts.items()}


def _kinds(root: str) -> list[str]:
    return sorted({f.profile.kind for f in Node(root, check=False).devices()} |
                  {c.profile.kind for c in Node(root, check=False).channels()})


def _cases(host: str, driver_root: Path) -> Iterator[tuple[str, dict[str, str]]]:
    root = str(HOSTS / host)
    base = GenerateOptions(root=root, hook_path=HOOK)
    for name, fields in OPTION_CASES.items():
        yield name, _rendered(replace(base, **fields), root)  # type: ignore[arg-type]
    yield "format=json", _rendered(base, root, "json")
    yield "hook-path=default", _rendered(replace(base, hook_path=None), root)
    for kind in _kinds(root):
        yield f"kind={kind}", _rendered(replace(base, kinds=(kind,)), root)
    found = Node(root, check=False).devices()
    every_other = frozenset(device_key(f.profile.kind, f.address) for f in found[::2])
    yield "exclude=every-other", _rendered(replace(base, exclude=every_other), root)
    if host == "hgx-h100":  # the driver's files moved under /run/nvidia/driver, GPU-operator style
        moved = str(driver_root / host)
        for target in (None, "/host"):
            opts = GenerateOptions(root=moved, hook_path=HOOK, driver_root="/run/nvidia/driver", target_root=target)
            yield f"driver-root,target-root={target}", _rendered(opts, moved)


def _digests(host: str, driver_root: Path) -> dict[str, dict[str, str]]:
    return {case: {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(texts.items())}
            for case, texts in _cases(host, driver_root)}


@pytest.fixture(scope="module")
def driver_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("driver-root")
    root = base / "hgx-h100"
    shutil.copytree(HOSTS / "hgx-h100", root, symlinks=True)
    driver = root / "run/nvidia/driver"
    for moved in ("usr/lib/x86_64-linux-gnu", "usr/bin", "lib/firmware", "etc"):
        (driver / moved).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(root / moved), str(driver / moved))
    (root / "etc").mkdir()
    shutil.copy(driver / "etc/os-release", root / "etc/os-release")
    return base


@pytest.mark.parametrize("host", HOST_NAMES)
def test_every_option_combination_writes_the_golden_specs(host: str, driver_root: Path, update_golden: bool) -> None:
    actual = _digests(host, driver_root)
    stored = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    if update_golden:
        stored[host] = actual
        DIGESTS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    expected = stored.get(host)
    assert expected is not None, f"{DIGESTS}: no digests for {host} (pytest --update-golden)"
    assert sorted(actual) == sorted(expected)
    for case, files in actual.items():
        assert files == expected[case], f"{host}, {case}: the specs differ from the golden digests"


def test_the_golden_digests_tell_the_options_apart() -> None:
    """The cases are not all alike: the options change the specs they are meant to change."""
    stored = json.loads(DIGESTS.read_text())
    workstation = stored["workstation"]
    assert workstation["default"] != workstation["strategies=index,uuid,pci"]
    assert workstation["default"] != workstation["target-root=/host"]
    assert any(len(cases) > 12 for cases in stored.values())  # a kind= case per kind, for hosts with several
    assert "driver-root,target-root=/host" in stored["hgx-h100"]
