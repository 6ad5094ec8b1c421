"""`devinject doctor`'s slice link against a real HTTPS server on loopback (its own CA, a kubeconfig as
cluster-up.sh writes one: tests/unit/test_kubeapi.py's) standing in for the API server: the node's
ResourceSlices of the DRA driver there or not, a pool complete or not, each device published, left out for the
device plugin or missing, its taints; the driver's /metrics count of refused publishes; the API's errors with
their fixes. On the real cluster: tests/e2e/test_doctor_live.py."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from devinject.api import Node
from devinject.cli import cli
from devinject.doctor import LINKS, DoctorOptions, MetricsUnanswered, check_link, publish_errors, slice_api
from devinject.dra.kubeapi import ResourceApi, credentials
from devinject.dra.slices import offers, resource_slices
from devinject.nodestate.ledger import Claim, Ledger
from tests.conftest import HOSTS
from tests.unit import test_kubeapi
from tests.unit.test_kubeapi import Recorder, certs, kubeconfig  # noqa: F401 - `server` needs `certs`

# the fake API server (pytest knows a fixture by the name it is bound to here)
fake_api_server = test_kubeapi.server


@pytest.fixture
def fake_api_ca(certs: Path) -> Path:  # noqa: F811 - test_kubeapi's fixture
    """The fake API server's certificate, its own CA."""
    return certs / "server.crt"

NODE_NAME = "node1"
DRIVER = "dra.devinject.io"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NAME = "nvidia.com/gpu=0"
GPU0 = "gpu-0000-18-00-0"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The HGX H100 fixture host (a symlink farm is not needed: the slice link reads its devices and kubelet
    dir only), with a kubelet dir."""
    import shutil

    host = tmp_path / "host"
    shutil.copytree(HOSTS / "hgx-h100", host, symlinks=True)
    (host / "var/lib/kubelet/plugins_registry").mkdir(parents=True)
    (host / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    return host


def register_dra(root: Path) -> None:
    (root / f"var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock").touch()


def the_slices(root: Path) -> list[dict[str, Any]]:
    """The slices the DRA driver publishes for this host (dra/slices.py), as the API server stores them."""
    node = Node(str(root))
    items = resource_slices(DRIVER, NODE_NAME, offers(node, NODE_NAME))
    return json.loads(json.dumps(items))  # type: ignore[no-any-return]


def answer(items: list[dict[str, Any]], status: int = 200) -> None:
    Recorder.answers[("GET", SLICES)] = (status, {"kind": "ResourceSliceList", "items": items} if status == 200
                                         else {"kind": "Status", "message": "resourceslices.resource.k8s.io is "
                                               "forbidden: User \"x\" cannot list resource \"resourceslices\""})


def api(tmp_path: Path, port: int, ca: Path) -> ResourceApi:
    return ResourceApi(credentials(str(kubeconfig(tmp_path / "kc", port, ca, token="s3cret"))), timeout=2, budget=2)


def link(root: Path, the_api: ResourceApi, device: str = NAME, state: Path | None = None,
         metrics: str | None = None) -> Any:
    node = Node(str(root), state_dir=str(state) if state else None)
    return check_link(node, device, "slice", DoctorOptions(kubelet_dir="/var/lib/kubelet", api=the_api,
                                                           node_name=NODE_NAME, metrics_address=metrics))


def test_slice_is_the_last_link():
    assert LINKS[-2:] == ("kubelet", "slice")


def test_registered_but_no_slices_is_broken_and_says_where_to_look(root: Path, tmp_path: Path, fake_api_server: int,
                                                                    fake_api_ca: Path) -> None:
    register_dra(root)
    answer([])
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is False
    assert check.detail == (f"the DRA driver is registered with the kubelet, but the API server has no "
                            f"ResourceSlice of {DRIVER} for node {NODE_NAME}")
    assert "--node-name must be this node's name in the API (node1" in check.fix
    assert "rbac.yaml" in check.fix
    # the call: this node's slices of this driver, with the kubeconfig's token
    (seen,) = Recorder.seen
    assert seen["path"] == f"{SLICES}?fieldSelector=spec.nodeName%3D{NODE_NAME}%2Cspec.driver%3Ddra.devinject.io"
    assert seen["auth"] == "Bearer s3cret"


def test_every_device_the_driver_publishes_is_found_by_its_name(root: Path, tmp_path: Path, fake_api_server: int,
                                                                 fake_api_ca: Path) -> None:
    register_dra(root)
    answer(the_slices(root))
    the_api = api(tmp_path, fake_api_server, fake_api_ca)
    node = Node(str(root))
    for found in node.devices():
        check = link(root, the_api, f"{found.profile.kind}={found.address}")
        assert check.ok is True, check
        assert "published in dra-devinject-io-node1-" in check.detail and "no taint" in check.detail
    check = link(root, the_api)
    assert check.detail.startswith(f"{GPU0} published in dra-devinject-io-node1-nvidia-com-gpu-0 (pool "
                                   "node1-nvidia-com-gpu at generation 1, ")


def test_a_taint_is_named_with_its_value_effect_and_time(root: Path, tmp_path: Path, fake_api_server: int,
                                                         fake_api_ca: Path) -> None:
    items = the_slices(root)
    device = next(d for s in items for d in s["spec"].get("devices", []) if d["name"] == GPU0)
    device["taints"] = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoExecute",
                         "timeAdded": "2026-12-01T23:00:00Z"}]
    answer(items)
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is False
    assert check.detail.endswith(f"is tainted: {DRIVER}/xid=79:NoExecute since 2026-12-01T23:00:00Z")
    assert "devinject put-back nvidia.com/gpu=0" in check.fix


def test_a_device_the_device_plugin_holds_is_left_out_on_purpose(root: Path, tmp_path: Path, fake_api_server: int,
                                                                 fake_api_ca: Path) -> None:
    items = the_slices(root)
    for item in items:
        item["spec"]["devices"] = [d for d in item["spec"].get("devices", []) if d["name"] != GPU0]
    answer(items)
    the_api = api(tmp_path, fake_api_server, fake_api_ca)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    check = link(root, the_api, state=state)
    assert check.ok is False and check.detail.startswith(f"{GPU0} is not in pool node1-nvidia-com-gpu")
    nodes = tuple(f"c {n.major}:{n.minor}" for n in Node(str(root)).find(NAME)[0].nodes)
    Ledger(str(state)).book_plugin("nvidia.com/gpu", {"0000:18:00.0": Claim(NAME, nodes)},
                                   {"0000:18:00.0": ["default/train"]}, policy={"nvidia.com/gpu": "exclusive"})
    check = link(root, the_api, state=state)
    assert check.ok is True, check
    assert "the device plugin holds it (the device plugin: nvidia.com/gpu device 0000:18:00.0, pod default/train)" \
        in check.detail


def test_an_incomplete_pool_and_a_missing_pool(root: Path, tmp_path: Path, fake_api_server: int,
                                               fake_api_ca: Path) -> None:
    items = the_slices(root)
    gpu_pool = [s for s in items if s["spec"]["pool"]["name"] == "node1-nvidia-com-gpu"]
    for item in gpu_pool:
        item["spec"]["pool"]["resourceSliceCount"] = 3
    answer(items)
    the_api = api(tmp_path, fake_api_server, fake_api_ca)
    check = link(root, the_api)
    assert check.ok is False
    assert check.detail.startswith(f"pool node1-nvidia-com-gpu at generation 1 is incomplete: {len(gpu_pool)} of "
                                   "its 3 slices")
    answer([s for s in items if s not in gpu_pool])
    check = link(root, the_api)
    assert check.ok is False and "have no pool node1-nvidia-com-gpu" in check.detail
    assert "--kind" in check.fix


class Metrics(BaseHTTPRequestHandler):
    text = ""

    def do_GET(self) -> None:
        data = self.text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_slice_the_api_server_refused_is_told_from_the_drivers_metrics(
        root: Path, tmp_path: Path, fake_api_server: int, fake_api_ca: Path, metrics: str) -> None:
    from devinject.dra.kubeapi import ApiError
    from devinject.dra.metrics import DraMetrics

    real = DraMetrics()  # the driver's own metrics text, two publishes refused with 422
    for _ in range(2):
        real.publish_failed(ApiError("create resourceslice x: 422 Invalid", status=422))
    Metrics.text = real.text().decode()
    assert publish_errors(metrics) == {"api-422": 2.0}
    register_dra(root)
    answer([])
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca), metrics=metrics)
    assert check.ok is False
    assert "count failed publishes: api-422 2; the API server refused its slices" in check.detail
    # nothing listens there: no word of it, and no wait beyond the deadline
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert publish_errors(f"127.0.0.1:{port}") == {}


def test_the_api_servers_errors_are_the_broken_link_with_their_fix(root: Path, tmp_path: Path, fake_api_server: int,
                                                                    fake_api_ca: Path) -> None:
    answer([], status=403)
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is False and check.detail.startswith("cannot list the node's ResourceSlices: 403 ")
    assert "kubectl auth can-i list resourceslices.resource.k8s.io" in check.fix
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    check = link(root, api(tmp_path, port, fake_api_ca))
    assert check.ok is False and check.detail.startswith("cannot list the node's ResourceSlices: ")
    assert "kubectl cluster-info" in check.fix


def test_a_device_plugin_node_needs_no_slices(root: Path, tmp_path: Path, fake_api_server: int,
                                              fake_api_ca: Path) -> None:
    (root / "var/lib/kubelet/device-plugins/devinject-nvidia.com-gpu.sock").touch()
    answer([])
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is True
    assert "the DRA driver does not run here (the device plugin serves nvidia.com/gpu)" in check.detail


def test_the_api_is_asked_only_when_credentials_are_given(tmp_path: Path, fake_api_server: int, fake_api_ca: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert slice_api(None, {}) is None  # no ~/.kube/config taken unasked
    config = kubeconfig(tmp_path / "kc", fake_api_server, fake_api_ca, token="t")
    assert slice_api(None, {"KUBECONFIG": str(config)}) is not None
    assert slice_api(str(config), {}) is not None


def test_the_command_takes_the_kubeconfig_and_refuses_one_that_is_not(root: Path, tmp_path: Path, fake_api_server: int,
                                                             fake_api_ca: Path) -> None:
    register_dra(root)
    answer(the_slices(root))
    config = kubeconfig(tmp_path / "kc", fake_api_server, fake_api_ca, token="t")
    done = CliRunner().invoke(cli, ["doctor", "--root", str(root), "--kubeconfig", str(config), "--node-name",
                                    NODE_NAME, "--dra-metrics", "", "--state-dir", str(tmp_path / "none"),
                                    "--json"])
    rows = json.loads(done.stdout)
    # the fixture's nodes are plain files: the walk stops there and the slice link is not checked
    assert rows and all(d["checks"][-1]["link"] == "slice" and d["checks"][-1]["ok"] is None for d in rows)
    # a kubeconfig that is not one: one line, a usage error
    bad = tmp_path / "bad"
    bad.write_text("just: text\n")
    done = CliRunner().invoke(cli, ["doctor", "--root", str(root), "--kubeconfig", str(bad)])
    assert done.exit_code == 2 and "not a kubeconfig" in done.output and "Traceback" not in done.output
    assert os.path.exists(config)


@contextmanager
def trickler(head: bytes, drip: bytes, rest: bytes, every: float = 1.5) -> Iterator[str]:
    """A server on loopback that sends `head` at once, then `drip` a byte every `every` seconds, then `rest`;
    its address. Each byte comes well within a 2 s timeout per read: only one deadline for the whole answer
    stops it. It stops when the client goes."""
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def serve() -> None:
        try:
            peer, _ = server.accept()
        except OSError:
            return
        with peer:
            try:
                peer.recv(4096)
                peer.sendall(head)
                for byte in drip:
                    time.sleep(every)
                    peer.sendall(bytes([byte]))
                peer.sendall(rest)
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        thread.join(timeout=10)


FAKE = b'devinject_dra_slice_publish_errors_total{reason="api-422"} 99\n'  # the counts a squatter would fake
DRIPPED = {  # where in the answer the bytes drip: the status line, a header, a chunk's size line
    "status line": (b"HTTP/1.1 2", b"00 ", b"OK\r\nContent-Length: %d\r\n\r\n%s" % (len(FAKE), FAKE)),
    "headers": (b"HTTP/1.1 200 OK\r\nContent-Le", b"ngt", b"h: %d\r\n\r\n%s" % (len(FAKE), FAKE)),
    "chunk size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"000",
                   b"%x\r\n%s\r\n0\r\n\r\n" % (len(FAKE), FAKE)),
}


@pytest.mark.parametrize("where", list(DRIPPED))
def test_a_metrics_answer_dripped_a_byte_every_1_5s_is_given_up_at_one_deadline(where: str) -> None:
    """Port 9401 is anyone's while the driver is down (which is when doctor runs): a server dripping a byte
    every 1.5 s in the status line, the headers or a chunk's size held doctor for as long as it liked (each
    read had its own 2 s), then had its fake counts believed. Now one 2 s deadline covers connect to last
    byte, and what came before it is not counted."""
    with (trickler(*DRIPPED[where]) as address,
          pytest.raises(MetricsUnanswered, match=r"^no whole answer within 2s; not counted$")):
        publish_errors(address)


def test_doctor_says_in_one_line_that_the_metrics_gave_no_answer(root: Path, tmp_path: Path, fake_api_server: int,
                                                                  fake_api_ca: Path) -> None:
    register_dra(root)
    answer([])
    with trickler(*DRIPPED["headers"]) as address:
        check = link(root, api(tmp_path, fake_api_server, fake_api_ca), metrics=address)
    assert check.ok is False and "\n" not in check.detail and "api-422" not in check.detail
    assert check.detail.endswith(f"; the driver's /metrics ({address}): no whole answer within 2s; not counted")


def test_a_metrics_body_that_trickles_is_cut_at_one_deadline_and_a_bad_address_is_no_answer() -> None:
    """/metrics sending a line every 0.3 s: each read met its own timeout, so the answer could hold doctor
    far past `timeout`; one deadline covers the whole answer, and a cut one is no answer. A port that is no
    number (or no ASCII number) reads as no answer (it raised ValueError before the try)."""
    body = b"# HELP filler a line\n" * 30
    with (trickler(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", body, b"", every=0.01) as address,
          pytest.raises(MetricsUnanswered)):
        publish_errors(address, timeout=1.0)
    assert publish_errors("127.0.0.1:metrics") == {} and publish_errors("127.0.0.1:9²01") == {}


# --- DeviceTaintRules: an admin's taints by selector (resource.k8s.io v1 in 1.37, v1beta2 in 1.36) -------------
RULES = "/apis/resource.k8s.io/{}/devicetaintrules"
NOT_FOUND = (404, {"kind": "Status", "message": "the server could not find the requested resource"})


def rule(name: str, selector: dict[str, str] | None, effect: str = "NoExecute") -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": {"key": "example.com/maintenance", "value": "rma", "effect": effect,
                                      "timeAdded": "2026-12-05T10:00:00Z"}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": name}, "spec": spec}


def rules(version: str, *items: dict[str, Any]) -> None:
    Recorder.answers[("GET", RULES.format(version))] = (200, {"kind": "DeviceTaintRuleList", "items": list(items)})


def test_a_device_taint_rule_that_selects_the_device_is_named_with_its_effect_and_removal(
        root: Path, tmp_path: Path, fake_api_server: int, fake_api_ca: Path) -> None:
    """A device an admin drained with a DeviceTaintRule looked healthy and free: its slice carries no taint
    (the rule is applied by the scheduler, not written into the slice). Now the rule is named, with its
    taint and the command that removes it; rules that select other devices, drivers or pools, or nothing (no
    selector), are not."""
    answer(the_slices(root))
    rules("v1", rule("drain-gpu0", {"driver": DRIVER, "pool": f"{NODE_NAME}-nvidia-com-gpu", "device": GPU0}),
          rule("other-device", {"device": "gpu-0000-2a-00-0"}), rule("other-driver", {"driver": "gpu.nvidia.com"}),
          rule("other-pool", {"pool": "node2-nvidia-com-gpu"}), rule("no-selector", None))
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is False
    assert check.detail.endswith("is tainted: example.com/maintenance=rma:NoExecute since 2026-12-05T10:00:00Z "
                                 "by DeviceTaintRule drain-gpu0"), check.detail
    assert check.fix.endswith("kubectl delete devicetaintrule drain-gpu0")
    assert "put-back" not in check.fix  # not the node's verdict: put-back would not clear it
    assert ("GET", RULES.format("v1")) in {(s["method"], s["path"]) for s in Recorder.seen}
    rules("v1", rule("every-device", {}))  # the empty selector selects every device
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca), "nvidia.com/gpu=1")
    assert check.ok is False and check.detail.endswith("by DeviceTaintRule every-device")


def test_rules_on_1_36_are_read_from_v1beta2_and_none_served_is_skipped_with_a_word(
        root: Path, tmp_path: Path, fake_api_server: int, fake_api_ca: Path) -> None:
    answer(the_slices(root))
    Recorder.answers[("GET", RULES.format("v1"))] = NOT_FOUND
    rules("v1beta2", rule("drain-pool", {"pool": f"{NODE_NAME}-nvidia-com-gpu"}, effect="NoSchedule"))
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is False and check.detail.endswith("rma:NoSchedule since 2026-12-05T10:00:00Z by "
                                                       "DeviceTaintRule drain-pool")
    Recorder.answers[("GET", RULES.format("v1beta2"))] = NOT_FOUND
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is True
    assert check.detail.endswith("no taint; DeviceTaintRules not checked: the API server serves them in neither "
                                 "resource.k8s.io v1 nor v1beta2 (the DRADeviceTaintRules gate)")


def test_a_rule_of_effect_none_is_said_and_a_refused_list_is_no_verdict(
        root: Path, tmp_path: Path, fake_api_server: int, fake_api_ca: Path) -> None:
    answer(the_slices(root))
    rules("v1", rule("watch-gpu0", {"device": GPU0}, effect="None"))
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is True and check.detail.endswith(
        "no taint; example.com/maintenance=rma:None since 2026-12-05T10:00:00Z by DeviceTaintRule watch-gpu0 "
        "(no effect on scheduling)")
    Recorder.answers[("GET", RULES.format("v1"))] = (403, {"kind": "Status", "message": "forbidden"})
    check = link(root, api(tmp_path, fake_api_server, fake_api_ca))
    assert check.ok is True and check.detail.endswith("no taint; DeviceTaintRules not checked: 403 forbidden")
