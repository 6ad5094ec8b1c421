"""The wheel alone: built from this tree, installed with its declared dependencies into a fresh virtualenv
outside the dev one (pip resolves them as a user's install would), and the device plugin and the DRA driver
started from it until they serve the kubelet, then stopped with SIGTERM; grpcio and protobuf at the lowest
versions pyproject.toml allows. It catches what the dev venv hides:
package data left out of the wheel, pins lower than the generated gRPC modules accept, a module that imports
something only the dev extras install.

Slow (a venv and a dependency install): marked live. Every step has a deadline."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.conftest import HOSTS
from tests.e2e.conftest import terminate
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_dra_cli import KUBECONFIG
from tests.unit.test_packaging import lower_bound

pytestmark = pytest.mark.live
REPO = Path(__file__).resolve().parents[2]


def run(*args: str | Path, timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv with the wheel installed, nothing of this tree on its path."""
    work = tmp_path_factory.mktemp("wheel")
    dist, tree = work / "dist", work / "tree"
    # from a copy of what git has (tracked or not ignored) of what the wheel is built from: in the checkout,
    # the editable install's egg-info would hand setuptools its file list, and hide what package-data misses
    listed = run("git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "pyproject.toml",
                 "README.md", "src", timeout=60, cwd=REPO).stdout.split("\n")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, tree,
        timeout=300, cwd=work)
    (wheel,) = dist.glob("devinject-*.whl")
    venv = work / "venv"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    assert base, "no base interpreter to make a venv with"
    run(base, "-m", "venv", venv, timeout=120, cwd=work)
    # at the lowest grpcio and protobuf pyproject.toml allows: what an install beside older packages gets
    floor = {name: ".".join(map(str, lower_bound(name))) for name in ("grpcio", "protobuf")}
    (work / "floor.txt").write_text("".join(f"{name}=={version}\n" for name, version in floor.items()))
    run(venv / "bin/pip", "install", "-q", "--disable-pip-version-check", "-c", work / "floor.txt", wheel,
        timeout=600, cwd=work)
    where = run(venv / "bin/python", "-c", "import devinject, google.protobuf, grpc; print(devinject.__file__); "
                "print(grpc.__version__, google.protobuf.__version__)", timeout=60, cwd=work).stdout.split("\n")
    assert where[0].startswith(str(venv)), where  # the wheel's copy, not this tree's
    def padded(version: str) -> tuple[int, ...]:
        return (*map(int, version.split(".")), 0, 0)[:3]

    got = dict(zip(("grpcio", "protobuf"), where[1].split(), strict=True))
    assert {k: padded(v) for k, v in got.items()} == {k: padded(v) for k, v in floor.items()}, where
    return venv / "bin"


def test_the_wheel_holds_the_package_data_and_imports_every_generated_module(installed: Path) -> None:
    code = ("import importlib, importlib.resources as r\n"
            "for m in ('deviceplugin.api.v1beta1_pb2_grpc', 'dra.api.dra_v1_pb2_grpc',"
            " 'dra.api.health_v1_pb2_grpc', 'dra.api.health_v1alpha1_pb2_grpc',"
            " 'dra.api.pluginregistration_v1_pb2_grpc'):\n"
            "    importlib.import_module('devinject.' + m)\n"
            "root = r.files('devinject')\n"
            "print(sorted(p.name for d in ('deviceplugin/api', 'dra/api') for p in root.joinpath(d).iterdir()"
            " if p.name.endswith(('.proto', '.pyi'))))\n"
            "print(len([p for p in root.joinpath('data/profiles').iterdir() if p.name.endswith('.yaml')]))\n")
    out = run(installed / "python", "-c", code, timeout=60, cwd=installed).stdout.splitlines()
    shipped = sorted(p.name for d in ("deviceplugin/api", "dra/api") for p in (REPO / "src/devinject" / d).iterdir()
                     if p.name.endswith((".proto", ".pyi")))
    assert out[0] == repr(shipped)
    assert int(out[1]) == len(list((REPO / "src/devinject/data/profiles").glob("*.yaml")))


def _wait_for(condition, what: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"exited while waiting for {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s:\n{log.read_text()}"
        time.sleep(0.1)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="whl-", dir="/tmp"))  # a unix socket path has at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_installed_device_plugin_registers_with_a_kubelet(installed: Path, host_copy, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                             short_dir: Path) -> None:
    host = host_copy("hgx-h100")
    kubelet = FakeKubelet(str(short_dir))
    kubelet.start()
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [installed / "devinject", "device-plugin", "--root", host, "--plugin-dir", short_dir,
             "--state-dir", tmp_path / "state", "--output-dir", tmp_path / "cdi",
             "--no-uevents", "--metrics-address", "127.0.0.1:0", "--hook-path", "/usr/bin/devinject"],
            stdout=out, stderr=out, cwd=tmp_path)
    try:
        _wait_for(lambda: "nvidia.com/gpu: registered with the kubelet" in log.read_text(), "registration",
                  process, log)
        _wait_for(lambda: len(kubelet.latest("nvidia.com/gpu") or {}) == 8, "8 GPUs listed", process, log)
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0, log.read_text()
    finally:
        terminate(process)
        kubelet.stop()
    assert "Traceback" not in log.read_text()


def test_the_installed_dra_driver_serves_the_kubelet(installed: Path, tmp_path: Path, short_dir: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)  # an API server that is not there: the kubelet side serves regardless
    (tmp_path / "state").mkdir(mode=0o755)
    log = tmp_path / "driver.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [installed / "devinject", "dra-driver", "--host-root", HOSTS / "hgx-h100", "--node-name", "node1",
             "--state-dir", tmp_path / "state", "--cdi-dir", tmp_path / "cdi", "--plugin-dir", short_dir / "plugins",
             "--registry-dir", short_dir / "registry", "--hook-path", "/usr/bin/devinject", "--rescan", "0.5",
             "--kubeconfig", kubeconfig], stdout=out, stderr=out, cwd=tmp_path)
    registration = short_dir / "registry" / "dra.devinject.io-reg.sock"
    try:
        _wait_for(registration.exists, "registration socket", process, log)
        with grpc.insecure_channel(f"unix://{registration}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)  # type: ignore[no-untyped-call]
        assert info.endpoint == str(short_dir / "plugins" / "dra.devinject.io" / "dra.sock")
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0, log.read_text()
    finally:
        terminate(process)
    assert "Traceback" not in log.read_text()
