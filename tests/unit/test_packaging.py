"""What an install from the wheel needs: every data file under src/devinject in package-data, and runtime
pins no lower than what the generated gRPC modules refuse to import under."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src/devinject"
GENERATED = sorted((PACKAGE / "deviceplugin/api").glob("*_pb2*.py")) + sorted((PACKAGE / "dra/api").glob("*_pb2*.py"))


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def lower_bound(package: str) -> tuple[int, ...]:
    (spec,) = [d for d in _pyproject()["project"]["dependencies"] if re.match(rf"{package}\b", d)]
    match = re.search(r">=\s*([\d.]+)", spec)
    assert match, f"{spec}: no lower bound"
    return tuple(int(p) for p in match.group(1).split("."))


def test_every_data_file_in_the_package_is_package_data():
    tracked = subprocess.run(["git", "ls-files", "src/devinject"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
    data = [Path(p).relative_to("src/devinject").as_posix() for p in tracked if not p.endswith(".py")]
    assert data, "git ls-files found nothing: not a checkout?"
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["devinject"]
    missing = [p for p in data if not any(fnmatch.fnmatchcase(p, g) for g in globs)]
    assert missing == [], f"not in [tool.setuptools.package-data]: {missing}"


def test_grpcio_pin_admits_no_version_the_generated_stubs_refuse():
    versions = {re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", p.read_text()).group(1)  # type: ignore[union-attr]
                for p in GENERATED if p.name.endswith("_grpc.py")}
    assert len(versions) == 1, versions  # one `make proto` run generated them all
    assert lower_bound("grpcio") >= tuple(int(p) for p in versions.pop().split("."))


def test_protobuf_pin_admits_no_version_the_generated_messages_refuse():
    pattern = re.compile(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
                         r"\s*(\d+),")
    versions = {tuple(int(g) for g in pattern.search(p.read_text()).groups())  # type: ignore[union-attr]
                for p in GENERATED if not p.name.endswith("_grpc.py")}
    assert len(versions) == 1, versions
    (needed,) = versions
    assert lower_bound("protobuf") >= needed
    (spec,) = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("protobuf")]
    # the runtime check refuses another major version too (gencode 7.x under protobuf 8 is an error)
    assert f"<{needed[0] + 1}" in spec.replace(" ", ""), spec


def test_the_image_pins_satisfy_the_package_pins():
    pins = dict(re.findall(r"^([\w-]+)==([\d.]+)", (REPO / "deploy/image/requirements.txt").read_text(), re.M))
    for package in ("grpcio", "protobuf"):
        assert tuple(int(p) for p in pins[package].split(".")) >= lower_bound(package), package


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def _closure(name: str, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """The installed distributions `name[extras]` needs, transitively: {normalised name: version}."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = [(name, extras)]
    while todo:
        current, wanted = todo.pop()
        dist = distribution(current)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                continue
            key = re.sub(r"[-_.]+", "-", req.name).lower()
            if key in found:
                continue
            try:
                found[key] = distribution(req.name).version
            except PackageNotFoundError:
                continue  # a dependency of another platform or Python
            todo.append((req.name, tuple(req.extras)))
    return found


def test_every_package_make_venv_installs_is_pinned_at_its_installed_version():
    """`make venv` installs devinject[dev] with -c constraints.txt: a package missing from it floats (a new
    grpcio-tools once regenerated the gRPC modules differently and failed a clean clone's `make test`)."""
    pins = _pins()
    needed = _closure("devinject", ("dev",))
    assert "grpcio-tools" in needed and "click" in needed
    wrong = {name: (version, pins.get(name)) for name, version in needed.items() if pins.get(name) != version}
    assert wrong == {}, f"installed (version, pinned) not as constraints.txt says: {wrong}"


def test_grpcio_tools_is_pinned_to_the_version_that_generated_the_modules():
    versions = {re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", p.read_text()).group(1)  # type: ignore[union-attr]
                for p in GENERATED if p.name.endswith("_grpc.py")}
    assert versions == {_pins()["grpcio-tools"]}
