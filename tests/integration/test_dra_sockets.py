"""The DRA driver's sockets and the streams on them. Before, under umask 000 the driver's sockets and the
directories it made were 0777, and uid 65534 called NodeUnprepareResources: the claim's spec and booking were
removed; eight open NodeWatchResources streams took every worker, and a prepare hit DEADLINE_EXCEEDED."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devinject.core.errors import DevinjectError
from devinject.dra.api import health_v1_pb2 as health
from devinject.dra.api import health_v1_pb2_grpc as health_grpc
from devinject.dra.api import health_v1alpha1_pb2 as health_alpha
from devinject.dra.api import health_v1alpha1_pb2_grpc as health_alpha_grpc
from devinject.dra.driver import DraDriver
from tests.integration.test_dra_driver import GPU_POOL, FakeApi, kubelet, make_driver, prepare, unprepare

UID = "0b7f8e7c-4444-4c1b-9a55-000000000001"
NOBODY = 65534


@pytest.fixture
def open_dirs() -> Iterator[dict[str, str]]:
    """The driver's directories below a directory anyone may traverse (as /var/lib/kubelet's parents are)."""
    top = Path(tempfile.mkdtemp(prefix="dra-sock-", dir="/tmp"))
    top.chmod(0o755)
    out = {name: str(top / "kubelet" / name) for name in ("plugins", "registry")}
    out |= {name: str(top / name) for name in ("cdi", "state")}
    os.makedirs(out["state"], mode=0o755)
    yield out
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def started(open_dirs: dict[str, str]) -> Iterator[DraDriver]:
    api = FakeApi()
    api.add("held", UID, [(GPU_POOL, "gpu-0000-2a-00-0")])
    old = os.umask(0)
    try:
        driver = make_driver(open_dirs, api)
        driver.start()
    finally:
        os.umask(old)
    driver.refresh()
    yield driver
    driver.servers.stop()


def test_under_umask_000_the_sockets_are_the_kubelets_alone(started: DraDriver, open_dirs: dict[str, str]) -> None:
    assert prepare(started, ("held", UID)).claims[UID].error == ""
    endpoint = started.servers.endpoint
    for path in (endpoint, started.servers.registration_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    for directory in (os.path.dirname(endpoint), open_dirs["plugins"], open_dirs["registry"],
                      os.path.dirname(open_dirs["plugins"])):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o750, directory
    if os.geteuid() != 0:
        return
    script = (f"import os, grpc; os.setgid({NOBODY}); os.setuid({NOBODY})\n"
              "from devinject.dra.api import dra_v1_pb2 as d, dra_v1_pb2_grpc as g\n"
              f"c = grpc.insecure_channel('unix://{endpoint}')\n"
              "try:\n"
              f"    g.DRAPluginStub(c).NodeUnprepareResources(d.NodeUnprepareResourcesRequest(claims=[d.Claim("
              f"namespace='default', name='held', uid='{UID}')]), timeout=5); print('unprepared')\n"
              "except grpc.RpcError as e: print('refused', e.code())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "refused StatusCode.UNAVAILABLE" in done.stdout, done.stdout + done.stderr
    assert os.path.exists(started.preparer.spec_path(UID)) and UID in started.preparer.prepared()
    assert unprepare(started, ("held", UID)).claims[UID].error == ""


def test_a_socket_directory_others_can_write_is_refused(open_dirs: dict[str, str]) -> None:
    socket_dir = Path(open_dirs["plugins"], "dra.devinject.io")
    socket_dir.mkdir(parents=True)
    socket_dir.chmod(0o777)
    driver = make_driver(open_dirs, FakeApi())
    with pytest.raises(DevinjectError, match="writable by group or others"):
        driver.start()
    driver.servers.stop()


def test_open_health_streams_never_starve_a_prepare(started: DraDriver) -> None:
    with kubelet(started.servers.endpoint) as channel:
        streams = []
        for n in range(12):  # both API versions, more than the cap
            stub = (health_grpc.DRAResourceHealthStub(channel) if n % 2 else  # type: ignore[no-untyped-call]
                    health_alpha_grpc.DRAResourceHealthStub(channel))  # type: ignore[no-untyped-call]
            request = health.NodeWatchResourcesRequest() if n % 2 else health_alpha.NodeWatchResourcesRequest()
            streams.append(stub.NodeWatchResources(request, timeout=30))
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(len(next(stream).devices))
            except grpc.RpcError as err:
                outcomes.append(err.code())
        assert outcomes.count(16) == 4 and outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8, outcomes
        answer = prepare(started, ("held", UID))  # 10 s deadline: served beside the open streams
        assert answer.claims[UID].error == ""
        assert unprepare(started, ("held", UID)).claims[UID].error == ""
        for stream in streams:
            stream.cancel()
