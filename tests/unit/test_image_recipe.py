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


def test_files_txt_keeps_journalctl_alone_of_systemd() -> None:
    files = mkimage.kept_files(mkimage.recipe_lines("files.txt"))
    assert files == (("systemd", "/usr/bin/journalctl"),)
    assert "libsystemd-shared" in mkimage.recipe_lines("packages.txt")  # its library, kept as a package
    for bad in ("systemd", "systemd usr/bin/journalctl", "systemd /usr/../etc/shadow", "a /b c"):
        with pytest.raises(mkimage.BuildError, match="files.txt"):
            mkimage.kept_files([bad])


def test_trim_keeps_a_listed_file_of_a_dropped_package_and_nothing_else_of_it(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    info = stage / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    (stage / "usr/bin").mkdir(parents=True)
    (stage / "bin").symlink_to("usr/bin")  # merged /usr: the package lists /bin/journalctl
    for name in ("journalctl", "systemctl", "python3"):
        (stage / "usr/bin" / name).write_text(name)
    (info / "systemd.list").write_text("/.\n/bin\n/bin/journalctl\n/bin/systemctl\n")
    (info / "python3.list").write_text("/.\n/usr\n/usr/bin\n/usr/bin/python3\n")
    (stage / "var/lib/dpkg/status").write_text("Package: systemd\nStatus: install ok installed\n\n"
                                               "Package: python3\nStatus: install ok installed\n")
    (stage / "var/lib/dpkg/alternatives").mkdir()
    installed = mkimage.parse_status((stage / "var/lib/dpkg/status").read_text())
    dropped = mkimage.trim(stage, {"python3"}, installed, (("systemd", "/usr/bin/journalctl"),))
    assert dropped == ["systemd"]
    assert sorted(p.name for p in (stage / "usr/bin").iterdir()) == ["journalctl", "python3"]
    with pytest.raises(mkimage.BuildError, match="is not a file of systemd"):
        mkimage.trim(stage, {"python3"}, installed, (("systemd", "/usr/bin/python3"),))
