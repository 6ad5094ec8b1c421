"""Every state file read both ways across a release: this tree reads what v0.1.0's agents wrote (an upgrade),
and v0.1.0's own code reads what this tree writes (a rollback). v0.1.0 runs from `git archive` of its commit,
in a child process whose PYTHONPATH points at it; this tree likewise. One scenario script
(statecompat/scenario.py) makes a node's state as the agents do (a DRA claim prepared through the driver, its
claim spec in the CDI dir, a device-plugin booking with its grant bound to a pod, a container's booking,
health verdicts, the health loop's state, a put-back and its request, time-slicing, device events) and reads
every file back through its owner, then goes on from there: the kubelet's prepare again after the restart
gets the same devices, claims on the plugin's, the container's and an unhealthy GPU are refused, a new claim
gets a free GPU, a broken ledger is rebuilt from the claims' copy. Each reader must see another release's
files exactly as it sees its own (docs/upgrade.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import devinject
from tests.conftest import HOSTS
from tests.previous_release import RELEASE, RELEASE_VERSION, REPO, extract

SCENARIO = Path(__file__).with_name("statecompat") / "scenario.py"
THIS = "this tree"
HOST = str(HOSTS / "hgx-h100")


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {RELEASE: extract(tmp_path_factory.mktemp("release"), "src") / "src", THIS: REPO / "src"}


@pytest.fixture(scope="module")
def container_pid() -> Iterator[int]:
    """A live process standing for the container whose booking the ledger holds (a dead one's is released)."""
    sleeper = subprocess.Popen(["sleep", "600"])
    yield sleeper.pid
    sleeper.kill()
    sleeper.wait(timeout=10)


Run = Callable[[str, str, Path], dict[str, Any]]


@pytest.fixture(scope="module")
def run(trees: dict[str, Path], container_pid: int) -> Run:
    def scenario(tree: str, verb: str, node: Path) -> dict[str, Any]:
        env = {**os.environ, "PYTHONPATH": str(trees[tree])}
        done = subprocess.run([sys.executable, str(SCENARIO), verb, str(node / "state"), str(node / "cdi"), HOST,
                               str(container_pid)], capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, f"{tree} {verb}: {done.stderr}"
        answer: dict[str, Any] = json.loads(done.stdout)
        assert answer["module"] == str(trees[tree] / "devinject" / "__init__.py")  # that tree's code ran
        return answer
    return scenario


@pytest.fixture(scope="module")
def written(run: Run, trees: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tree's node state, written once: copied before each read (a read goes on from it)."""
    nodes = {}
    for tree in trees:
        node = tmp_path_factory.mktemp("written")
        (node / "state").mkdir(mode=0o755)
        (node / "cdi").mkdir()
        assert run(tree, "write", node)["version"] == (devinject.__version__ if tree == THIS else RELEASE_VERSION)
        nodes[tree] = node
    return nodes


def read(run: Run, written: dict[str, Path], writer: str, reader: str, scratch: Path) -> dict[str, Any]:
    node = scratch / f"{writer}-read-by-{reader}".replace(" ", "-")
    shutil.copytree(written[writer], node, symlinks=True)
    answer = run(reader, "read", node)
    del answer["module"]
    return answer


@pytest.fixture(scope="module")
def own_reads(run: Run, written: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What each tree reads and does from its own files: the standard another release's files are held to."""
    scratch = tmp_path_factory.mktemp("own")
    return {tree: read(run, written, tree, tree, scratch) for tree in written}


CLAIMED_UID = "0b7f8e7c-aaaa-4c1b-9a55-000000000001"
NEW_UID = "0b7f8e7c-aaaa-4c1b-9a55-000000000005"
CLAIM_BOOKING = f"dra-claim:dra.devinject.io:{CLAIMED_UID}"
PLUGIN_BOOKING = "device-plugin:nvidia.com/gpu:GPU-2a"
CONTAINER = "ctr-0000000000000000000000000000000000000000000000000000000000000001"


def test_each_tree_reads_its_own_node_state_whole(own_reads: dict[str, Any]) -> None:
    """The scenario's own checks: every booking, claim and verdict read back and acted on (what the
    cross-release reads are compared with must itself be the whole state)."""
    for answer in own_reads.values():
        seen = answer["read"]
        assert sorted(seen["ledger"]) == [CONTAINER, PLUGIN_BOOKING, CLAIM_BOOKING]
        assert list(seen["claims"]) == [CLAIMED_UID] and seen["claimed_for_pod"] == ["nvidia.com/gpu=gpu-0000-18-00-0"]
        assert seen["specs"] == {f"dra.devinject.io-{CLAIMED_UID}.json": [f"{CLAIMED_UID}-gpu-0000-18-00-0"]}
        assert seen["health"][0] == ["c 195:7"] and seen["sharing"][0] == {"nvidia.com/rdma": 2}
        assert seen["grants"] == [[["nvidia.com/gpu=0000:2a:00.0"], []], []]  # bound to its pod, no other
        assert list(seen["put_back_requests"]) == list(seen["put_backs"]) == ["nvidia.com/gpu=0000:5d:00.0"]
        assert list(seen["events"]) == ["nvidia.com/gpu=0000:ab:00.0"] and seen["health_state"][2] == "boot-1"
        assert seen["rebuilt_from_claims_copy"] == [PLUGIN_BOOKING, CLAIM_BOOKING]
        assert (answer["rebook_refused"], answer["orphans"]) == (0, [])
        assert answer["prepared_again"] == [f"dra.devinject.io/claim={CLAIMED_UID}-gpu-0000-18-00-0"]
        assert "held by the device plugin" in answer["on_plugins"] and CONTAINER in answer["on_containers"]
        assert "unhealthy" in answer["on_unhealthy"] and CLAIM_BOOKING in answer["plugin_on_claim"]
        assert answer["new"] == [f"dra.devinject.io/claim={NEW_UID}-gpu-0000-5d-00-0"]
        assert sorted(answer["after"]["ledger"]) == [CONTAINER, PLUGIN_BOOKING, f"dra-claim:dra.devinject.io:{NEW_UID}"]
        assert list(answer["after"]["specs"]) == [f"dra.devinject.io-{NEW_UID}.json"]  # the unprepared one's gone


@pytest.mark.parametrize(("writer", "reader"), [(RELEASE, THIS), (THIS, RELEASE)], ids=["upgrade", "rollback"])
def test_a_release_reads_the_other_releases_node_state_as_its_own(
        run: Run, written: dict[str, Path], own_reads: dict[str, Any], tmp_path: Path, writer: str,
        reader: str) -> None:
    """Upgrade: this tree on v0.1.0's files; rollback: v0.1.0 on this tree's. Every file is read as the reader
    reads its own (no booking, claim, grant or verdict lost, nothing refused or rebuilt), and the agents go on
    from it alike: the same devices for a claim prepared again, the same refusals, a new claim, the claim
    the other release prepared unprepared by this one (its spec removed)."""
    got, own = read(run, written, writer, reader, tmp_path), own_reads[reader]
    differing = [f"{key}: {got.get(key)!r} (its own: {own.get(key)!r})" for key in sorted(set(got) | set(own))
                 if got.get(key) != own.get(key)]
    assert not differing, f"{reader} on {writer}'s files:\n" + "\n".join(differing)
