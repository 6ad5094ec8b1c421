"""Two pods of one agent on a node, as a rolling update with maxSurge overlaps them: each serves on sockets named
with its pod's UID, stopping removes its own alone, the DRA claims' changes wait for each other across
processes, and a metrics port the old pod still holds is taken once it is free. Live on the real cluster:
tests/e2e/test_rolling_upgrade_live.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from devinject.agent.metricsserver import MetricsServer, WaitingMetricsServer, serve_or_wait
from devinject.core.errors import DevinjectError
from devinject.dra.api import pluginregistration_v1_pb2 as reg
from devinject.dra.api import pluginregistration_v1_pb2_grpc as reg_grpc
from devinject.dra.driver import DraDriver
from devinject.dra.kubeletplugin import socket_names
from devinject.linux.filelock import exclusive
from tests.integration.fake_kubelet import FakeKubelet
from tests.integration.test_device_plugin import start_agent
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, FakeApi, kubelet, make_driver, prepare, unprepare

OLD = "0b7f8e7c-4444-4c1b-9a55-00000000000a"
NEW = "0b7f8e7c-4444-4c1b-9a55-00000000000b"
CLAIM = "0b7f8e7c-4444-4c1b-9a55-000000000001"


@pytest.fixture
def dirs() -> Iterator[dict[str, str]]:
    top = Path(tempfile.mkdtemp(prefix="roll-", dir="/tmp"))  # short: a unix socket path has 107 bytes
    out = {name: str(top / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(out["state"], mode=0o755)
    yield out
    shutil.rmtree(top, ignore_errors=True)


def pod_driver(dirs: dict[str, str], api: FakeApi, pod_uid: str | None) -> DraDriver:
    driver = make_driver(dirs, api)
    driver.opts = replace(driver.opts, pod_uid=pod_uid)
    return DraDriver(driver.opts, api)


def test_socket_names_carry_the_pod_uid_as_the_kubelet_plugin_library_names_them() -> None:
    assert socket_names(DRIVER, None) == (f"{DRIVER}-reg.sock", "dra.sock")  # on the host: as before
    assert socket_names(DRIVER, OLD) == (f"{DRIVER}-{OLD}-reg.sock", f"dra-{OLD}.sock")
    for bad in ("../x", "", OLD.upper(), OLD + "/a", "0b7f8e7c"):
        with pytest.raises(DevinjectError, match="not a pod UID"):
            socket_names(DRIVER, bad)


def test_two_driver_pods_overlap_and_the_old_ones_stop_leaves_the_new_ones_sockets(dirs: dict[str, str]) -> None:
    api = FakeApi()
    api.add("roll", CLAIM, [(GPU_POOL, "gpu-0000-2a-00-0")])
    old, new = pod_driver(dirs, api, OLD), pod_driver(dirs, api, NEW)
    old.start()
    try:
        new.start()
        try:
            for driver, uid in ((old, OLD), (new, NEW)):
                registration = os.path.join(dirs["registry"], f"{DRIVER}-{uid}-reg.sock")
                assert driver.servers.registration_path == registration
                with kubelet(registration) as channel:
                    info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)  # type: ignore[no-untyped-call]
                assert (info.name, info.endpoint) == (DRIVER, os.path.join(dirs["plugins"], DRIVER, f"dra-{uid}.sock"))
            assert prepare(old, ("roll", CLAIM)).claims[CLAIM].error == ""  # before the roll
        finally:
            old.servers.stop()
        assert sorted(os.listdir(dirs["registry"])) == [f"{DRIVER}-{NEW}-reg.sock"]
        assert sorted(os.listdir(os.path.join(dirs["plugins"], DRIVER))) == [f"dra-{NEW}.sock"]
        # the new pod unprepares what the old one prepared: the checkpoint is the node's, not the pod's
        assert unprepare(new, ("roll", CLAIM)).claims[CLAIM].error == ""
        assert not os.path.exists(new.preparer.spec_path(CLAIM))
    finally:
        new.servers.stop()
    assert os.listdir(dirs["registry"]) == []


def test_a_claim_waits_for_another_processs_claim_change_on_the_state_dir(dirs: dict[str, str]) -> None:
    """The other pod's prepare holds the claims lock (here: another open of it, as a process's would be):
    this one's waits and then prepares. With a lock of this process's threads alone, both would change the
    checkpoint at once and one's claim could be lost from it."""
    api = FakeApi()
    api.add("roll", CLAIM, [(GPU_POOL, "gpu-0000-2a-00-0")])
    driver = pod_driver(dirs, api, NEW)
    driver.start()
    try:
        answers: list[str] = []
        held = exclusive(driver.preparer.checkpoint.path + ".lock", timeout=5, what="claims")
        with held:
            waiting = threading.Thread(target=lambda: answers.append(prepare(driver, ("roll", CLAIM))
                                                                     .claims[CLAIM].error))
            waiting.start()
            waiting.join(1.5)
            assert waiting.is_alive() and answers == []
            assert CLAIM not in driver.preparer.checkpoint.load()
        waiting.join(15)
        assert answers == [""] and CLAIM in driver.preparer.prepared()
    finally:
        driver.servers.stop()


def test_a_bad_pod_uid_is_refused_before_any_socket(dirs: dict[str, str]) -> None:
    with pytest.raises(DevinjectError, match="--pod-uid '../../x': not a pod UID"):
        pod_driver(dirs, FakeApi(), "../../x")
    assert not os.path.exists(dirs["registry"])


def test_the_cli_refuses_a_bad_pod_uid_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "devinject", "device-plugin", "--pod-uid", "x/y", "--root",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--pod-uid 'x/y': not a pod UID" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class DroppingKubelet(FakeKubelet):
    """The kubelet's device manager as 1.36's is: a new registration of a resource replaces the old one, and
    when the old plugin's stream ends it disconnects whichever registration is current (the new one's)."""

    def _watch(self, plugin):  # type: ignore[no-untyped-def]
        super()._watch(plugin)
        with self.changed:
            current = self.plugins.get(plugin.request.resource_name)
            if current is not None and current is not plugin and self.server is not None:
                current.channel.close()  # its stream ends: the newer plugin must register again
                del self.plugins[plugin.request.resource_name]
                self.changed.notify_all()


def test_two_device_plugin_pods_overlap_and_the_new_one_keeps_the_resource(host_copy, tmp_path,  # type: ignore[no-untyped-def]
                                                                        plugin_dir) -> None:
    kubelet = DroppingKubelet(str(plugin_dir))
    kubelet.start()
    root = host_copy("hgx-h100")
    old = start_agent(root, plugin_dir, tmp_path / "old", pod_uid=OLD)
    new = None
    try:
        gpu = "nvidia.com/gpu"
        assert kubelet.wait_for(lambda: kubelet.latest(gpu)), "the old pod never registered"
        assert kubelet.plugins[gpu].request.endpoint == f"devinject-nvidia.com-gpu-{OLD}.sock"
        new = start_agent(root, plugin_dir, tmp_path / "new", pod_uid=NEW)
        new_endpoint = f"devinject-nvidia.com-gpu-{NEW}.sock"
        assert kubelet.wait_for(lambda: gpu in kubelet.plugins and kubelet.plugins[gpu].request.endpoint
                                == new_endpoint and kubelet.latest(gpu))
        count = len(kubelet.registrations)
        old.stop.set()
        old.thread.join(timeout=10)
        assert not old.thread.is_alive()
        ours = sorted(p.name for p in plugin_dir.iterdir() if p.name.startswith("devinject-"))
        assert ours == [new_endpoint, f"devinject-nvidia.com-rdma-{NEW}.sock"]
        # the old pod's exit dropped the new registration; the new pod registered again
        assert kubelet.wait_for(lambda: len(kubelet.registrations) > count and gpu in kubelet.plugins
                                and kubelet.plugins[gpu].request.endpoint == new_endpoint and kubelet.latest(gpu))
        assert kubelet.wait_for(lambda: new.get("/readyz")[0] == 200)
    finally:
        for running in (old, new):
            if running is not None:
                running.stop.set()
                running.thread.join(timeout=10)
        kubelet.stop()


class NoMetrics:
    def text(self) -> bytes:
        return b""


def test_a_metrics_port_in_use_is_taken_once_it_is_free() -> None:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    address = f"127.0.0.1:{holder.getsockname()[1]}"
    server = serve_or_wait(address, NoMetrics(), lambda: True, lambda: True, retry=0.05)
    try:
        assert isinstance(server, WaitingMetricsServer) and server.server is None
        holder.close()
        deadline = time.monotonic() + 10
        while server.server is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(server.server, MetricsServer)
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as answer:
            assert answer.status == 200
    finally:
        server.shutdown()
        holder.close()


def test_a_health_loop_started_beside_another_takes_the_state_dir_once_it_is_free(host_copy, tmp_path,  # type: ignore[no-untyped-def]
                                                                                  monkeypatch) -> None:
    """The new device-plugin pod of a roll starts while the old one's loop holds the state dir: it runs without
    the lock (after its patience, with a warning), asks for it, and holds it once the old pod is gone (before,
    it never took it, and a dra-driver --health auto could take it over: two loops on one state dir)."""
    from devinject.agent import healthstate
    from devinject.agent.watch import Watcher, WatchOptions
    from devinject.specs.generate import GenerateOptions

    patient = Watcher.wait_for_state_dir
    monkeypatch.setattr(Watcher, "wait_for_state_dir", lambda self, stop, patience=20.0: patient(self, stop, 0.3))
    state = tmp_path / "state"
    state.mkdir()
    held = healthstate.take_loop_lock(str(state))
    assert held is not None
    gen = GenerateOptions(root=str(host_copy("hgx-h100")), hook_path="/usr/bin/devinject")
    watcher = Watcher(WatchOptions(generate=gen, output_dir=tmp_path / "cdi", state_dir=str(state),
                                   interval=0.1, recheck=0.05, threshold=2, rescan=3600, uevents=False))
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not (watcher.generation and healthstate.loop_wanted(str(state))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.loop_lock is None and healthstate.loop_wanted(str(state))  # running, and asking
        os.close(held)  # the old pod is gone
        deadline = time.monotonic() + 20
        while watcher.loop_lock is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.loop_lock is not None and not healthstate.loop_wanted(str(state))
    finally:
        stop.set()
        thread.join(10)
