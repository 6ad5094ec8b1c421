"""What `make image` builds the agent's image from (deploy/image/, tools/mkimage.py), checked without building
it: the pins meet pyproject's dependencies, the manifests name the image it writes, and the rule that keeps
only the run-time packages' dependency closure. The build itself: tests/e2e/test_image_live.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from tools import mkimage

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _pins() -> dict[str, tuple[str, str]]:
    pins = {}
    for line in mkimage.recipe_lines("requirements.txt"):
        requirement, _, hashes = line.partition(" ")
        name, _, version = requirement.partition("==")
        pins[name.lower().replace("_", "-")] = (version, hashes)
    return pins


def test_pinned_wheels_meet_pyproject_and_are_hashed() -> None:
    pins = _pins()
    dependencies = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    pinned = [d for d in dependencies if d.name.lower() in pins]
    assert {d.name.lower() for d in pinned} >= {"grpcio", "protobuf", "prometheus-client", "nvidia-ml-py"}
    for dependency in pinned:
        version, hashes = pins[dependency.name.lower()]
        assert dependency.specifier.contains(version), (dependency, version)
    assert all(hashes.startswith("--hash=sha256:") for _, hashes in pins.values())


def test_kustomization_names_the_image_make_image_writes() -> None:
    kustomization = yaml.safe_load((REPO / "deploy/kubernetes/kustomization.yaml").read_text())
    daemonset = yaml.safe_load((REPO / "deploy/kubernetes/daemonset.yaml").read_text())
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "device-plugin"]
    (image,) = [i for i in kustomization["images"] if i["name"] == container["image"].split(":")[0]]
    assert f"{image['newName']}:{image['newTag']}" == f"localhost/devinject:{PYPROJECT['project']['version']}"


STATUS = """Package: app
Status: install ok installed
Depends: libfoo (>= 1.0), awk | mawk, python3:any

Package: libfoo
Status: install ok installed
Pre-Depends: libc6

Package: libc6
Status: install ok installed

Package: gawk-less-awk
Status: install ok installed
Provides: awk

Package: python3
Status: install ok installed
Depends: libexpat1

Package: libexpat1
Status: install ok installed

Package: mawk
Status: install ok installed

Package: perl-base
Status: install ok installed
Essential: yes

Package: gone
Status: deinstall ok config-files
"""


def test_closure_keeps_the_roots_and_what_they_need_only() -> None:
    installed = mkimage.parse_status(STATUS)
    assert "gone" not in installed
    assert mkimage.closure(installed, ["app"]) == {"app", "libfoo", "libc6", "gawk-less-awk", "python3",
                                                      "libexpat1"}


def test_closure_refuses_an_unmet_dependency_or_root() -> None:
    installed = mkimage.parse_status(STATUS.replace("Package: libfoo", "Package: libbar"))
    with pytest.raises(mkimage.BuildError, match=r"app: dependency libfoo is not installed"):
        mkimage.closure(installed, ["app"])
    with pytest.raises(mkimage.BuildError, match=r"packages.txt: not installed by mmdebstrap: nope"):
        mkimage.closure(installed, ["nope"])
