"""One truth about health: `list`, `health` and the API give the verdict the node agent acts on (health.json,
what the ledger and the DRA driver read), put-backs included; with no agent, a fresh check that honours the
put-backs recorded in the state dir; a state file that cannot be read is one line naming it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.agent import healthstate
from devinject.api import Node
from tests.unit.test_health_state import KEY, gpu_names, rounds, start
from tests.unit.test_watch import options

DEVINJECT = str(Path(sys.executable).parent / "devinject")
XID_79 = "Dec  1 20:00:00 node kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n"


@pytest.fixture
def node_with_xid(host_copy, tmp_path):
    root = host_copy("hgx-h100")
    log = root / "var/log/kern.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("Dec  1 19:00:00 node kernel: boot\n" + XID_79)
    return root, tmp_path / "state", tmp_path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DEVINJECT, *args], capture_output=True, text=True, timeout=120)


def verdict(root: Path, state: Path, command: str = "health") -> str:
    done = cli(command, "--root", str(root), "--state-dir", str(state), "--kernel-log", "/var/log/kern.log",
               "--json")
    rows = {r["pci_address"]: r for r in json.loads(done.stdout)}
    return rows["0000:18:00.0"]["health"]


def api_verdict(root: Path, state: Path) -> tuple[str, str]:
    node = Node(str(root), state_dir=str(state), kernel_log="/var/log/kern.log")
    health = {h.pci_address: h.health for h in node.health()}["0000:18:00.0"]
    listed = {r.pci_address: r.health for r in node.inventory()}["0000:18:00.0"]
    return health, listed


def test_with_no_agent_a_put_back_is_honoured_by_list_and_health(node_with_xid):
    root, state, _ = node_with_xid
    assert verdict(root, state) == "unhealthy" and verdict(root, state, "list") == "unhealthy"
    healthstate.request_put_back(str(root), str(state), "nvidia.com/gpu=0", kernel_log="/var/log/kern.log")
    assert verdict(root, state) == "healthy" and verdict(root, state, "list") == "healthy"
    assert api_verdict(root, state) == ("healthy", "healthy")
    with open(root / "var/log/kern.log", "a") as handle:  # a new fault after the put-back counts again
        handle.write(XID_79)
    assert verdict(root, state) == "unhealthy" and api_verdict(root, state) == ("unhealthy", "unhealthy")


def test_list_and_health_agree_with_the_agent_through_a_put_back_and_a_restart(node_with_xid):
    root, state, tmp_path = node_with_xid
    opts = options(root, tmp_path)
    w = start(opts)  # reads the log from its end: the Xid already there is history to it ...
    with open(root / "var/log/kern.log", "a") as handle:
        handle.write(XID_79)  # ... this one is a fault
    rounds(w, 1)
    assert "0" not in gpu_names(tmp_path)
    assert verdict(root, state) == "unhealthy" and verdict(root, state, "list") == "unhealthy"
    done = cli("put-back", "--root", str(root), "--state-dir", str(state), "--kernel-log", "/var/log/kern.log",
               KEY)
    assert done.returncode == 0, done.stderr
    assert rounds(w, 3) == [False, False, True] and "0" in gpu_names(tmp_path)  # the agent serves it again
    assert verdict(root, state) == "healthy" and verdict(root, state, "list") == "healthy"
    assert api_verdict(root, state) == ("healthy", "healthy")
    done = cli("health", "--root", str(root), "--state-dir", str(state), "--kernel-log", "/var/log/kern.log")
    assert done.returncode == 0, done.stdout  # every device healthy, as the agent says
    w = start(opts)  # a restart: the agent and the readers still agree
    assert "0" in gpu_names(tmp_path) and verdict(root, state) == "healthy"


def test_a_reading_the_agent_has_not_confirmed_is_degraded_not_unhealthy(node_with_xid):
    root, state, tmp_path = node_with_xid
    gpu = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
    healthstate.request_put_back(str(root), str(state), KEY, kernel_log="/var/log/kern.log")
    w = start(options(root, tmp_path))
    (root / gpu / "enable").write_text("0\n")
    rounds(w, 1)  # one failed check of three: still served
    assert "0" in gpu_names(tmp_path) and verdict(root, state) == "degraded"
    rounds(w, 2)
    assert "0" not in gpu_names(tmp_path) and verdict(root, state) == "unhealthy"


@pytest.mark.parametrize("name", ["health.json", healthstate.PUT_BACKS_FILE])
@pytest.mark.parametrize("command", ["health", "list"])
def test_a_corrupt_state_file_is_one_line_naming_it(node_with_xid, name, command):
    root, state, _ = node_with_xid
    state.mkdir(parents=True, exist_ok=True)
    (state / name).write_text('{"devices": ')
    done = cli(command, "--root", str(root), "--state-dir", str(state), "--kernel-log", "/var/log/kern.log")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"devinject: error: {state / name}: not JSON"), lines
    assert done.stdout == ""


def test_a_health_file_of_the_wrong_shape_is_one_line_naming_the_field(node_with_xid):
    root, state, _ = node_with_xid
    state.mkdir(parents=True, exist_ok=True)
    (state / "health.json").write_text(json.dumps({"unhealthy_nodes": [], "devices": {KEY: {"published": "fine"}}}))
    done = cli("health", "--root", str(root), "--state-dir", str(state), "--kernel-log", "/var/log/kern.log")
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"devinject: error: {state / 'health.json'}.devices[{KEY!r}].published: expected one of healthy, degraded, "
        "unhealthy (not a devinject health file: the ledger books nothing while it is there; the agent writes it "
        "again at its next change, or remove it)"]
