"""What a container of a Kubernetes pod gets from the hook: only what the node's device plugin granted it (a
token in its env naming a root-owned record) and the DRA claims booked for its pod; never a name a pod user
wrote (nodestate/grants.py, hook/request.py `pod_request`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devinject.hook.request import Request, pod_request
from devinject.install.hooksd import pod_annotation_passthrough
from devinject.nodestate import grants
from devinject.nodestate.grants import grant_env_key, prune, redeem, write_grant

POD = "8f0d3b4e-5a9c-4d3e-9f1a-2b7c6d5e4f3a"
OTHER = "0c6e2f1a-7b3d-4e5f-8a9b-1c2d3e4f5a6b"
ALL = Request(("nvidia.com/gpu=all",), "annotation")


def env_for(token: str) -> tuple[str, ...]:
    return ("PATH=/bin", f"{grant_env_key('nvidia.com/gpu')}={token}")


def test_a_pod_annotation_alone_gets_nothing(tmp_path: Path) -> None:
    request, notes = pod_request(ALL, ("PATH=/bin",), POD, str(tmp_path))
    assert request.names == () and "nvidia.com/gpu=all" in notes[0] and "ignored" in notes[0]


def test_a_grant_is_the_request_and_binds_to_the_first_pod(tmp_path: Path) -> None:
    token = write_grant(str(tmp_path), "nvidia.com/gpu", ("nvidia.com/gpu=3",))
    assert len(token) == 32 and grant_env_key("nvidia.com/gpu") == "DEVINJECT_GRANT_NVIDIA_COM_GPU"
    directory = tmp_path / "grants"
    assert (directory.stat().st_mode & 0o777, (directory / f"{token}.json").stat().st_mode & 0o777) == (0o700, 0o600)
    for _ in range(2):  # a restarted container of the pod presents it again
        request, notes = pod_request(ALL, env_for(token), POD, str(tmp_path))
        assert (request.names, request.source) == (("nvidia.com/gpu=3",), "grant") and "gpu=all" in notes[0]
    request, notes = pod_request(ALL, env_for(token), OTHER, str(tmp_path))
    assert request.names == () and "bound to another pod" in notes[0]


@pytest.mark.parametrize("token", ["0" * 32, "../../etc/passwd", "A" * 32, ""])
def test_a_forged_or_guessed_token_gets_nothing(tmp_path: Path, token: str) -> None:
    write_grant(str(tmp_path), "nvidia.com/gpu", ("nvidia.com/gpu=3",))
    request, notes = pod_request(Request((), ""), env_for(token), POD, str(tmp_path))
    assert request.names == () and "no such grant" in notes[0]


def test_a_record_anyone_else_could_write_is_no_grant(tmp_path: Path) -> None:
    token = write_grant(str(tmp_path), "nvidia.com/gpu", ("nvidia.com/gpu=3",))
    record = tmp_path / "grants" / f"{token}.json"
    os.chmod(record, 0o666)
    assert redeem(str(tmp_path), [token], POD) == ([], [f"grant {token[:8]}...: no such grant"])
    os.chmod(record, 0o600)
    os.chmod(tmp_path / "grants", 0o777)  # a directory others can write: nothing in it counts
    names, notes = redeem(str(tmp_path), [token], POD)
    assert names == [] and "writable by group or others" in notes[0]


def test_a_linked_record_is_not_followed(tmp_path: Path) -> None:
    token = write_grant(str(tmp_path), "nvidia.com/gpu", ("nvidia.com/gpu=3",))
    other = write_grant(str(tmp_path), "nvidia.com/gpu", ("nvidia.com/gpu=all",))
    record = tmp_path / "grants" / f"{token}.json"
    record.unlink()
    record.symlink_to(tmp_path / "grants" / f"{other}.json")
    assert redeem(str(tmp_path), [token], POD)[0] == []


def test_a_dra_claim_booked_for_the_pod_counts_when_named(tmp_path: Path) -> None:
    (tmp_path / "ledger.json").write_text(json.dumps({"allocations": {
        "dra-claim:x": {"devices": ["nvidia.com/gpu=1"], "pods": [POD], "exclusive": [], "pid": 1,
                        "start_time": 1, "state": "active"},  # as the ledger books a claim
        "dra-claim:y": {"devices": ["nvidia.com/gpu=2"], "pods": [OTHER], "exclusive": [], "pid": 1,
                        "start_time": 1, "state": "active"}}}))
    asked = Request(("nvidia.com/gpu=1", "nvidia.com/gpu=2"), "annotation")
    request, notes = pod_request(asked, (), POD, str(tmp_path))
    assert request.names == ("nvidia.com/gpu=1",) and "nvidia.com/gpu=2" in notes[0]


def test_prune_drops_stale_grants_only(tmp_path: Path) -> None:
    fresh = write_grant(str(tmp_path), "r", ("k=0",))
    old = write_grant(str(tmp_path), "r", ("k=1",))
    bound_live = write_grant(str(tmp_path), "r", ("k=2",))
    bound_gone = write_grant(str(tmp_path), "r", ("k=3",))
    redeem(str(tmp_path), [bound_live], POD)
    redeem(str(tmp_path), [bound_gone], OTHER)
    later = os.stat(tmp_path / "grants" / f"{fresh}.json").st_mtime + grants.STALE_UNBOUND + 1
    os.utime(tmp_path / "grants" / f"{fresh}.json", (later, later))
    assert prune(str(tmp_path), now=later, live_pods={POD}) == 2
    left = sorted(p.name for p in (tmp_path / "grants").iterdir())
    assert left == sorted([f"{fresh}.json", f"{bound_live}.json", f"{bound_live}.pod"]) and old not in str(left)


def test_install_hook_says_when_containerd_passes_pod_cdi_annotations(tmp_path: Path) -> None:
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    assert pod_annotation_passthrough(str(tmp_path)) == []
    section = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
    for patterns, passes in ((['"io.kubernetes.cri.*"'], False), (['"cdi.k8s.io/*"'], True),
                             (['"cdi.k8s.io/devinject_*"'], True)):
        config.write_text(section + f"pod_annotations = [{', '.join(patterns)}]\n")
        lines = pod_annotation_passthrough(str(tmp_path))
        assert bool(lines) == passes, (patterns, lines)
    assert lines[0].startswith(f"{config}: ") and "runc: cdi.k8s.io/devinject_*" in lines[0]
    config.write_text("not toml [")
    assert "pod annotations not checked" in pod_annotation_passthrough(str(tmp_path))[0]


def test_a_containerd_drop_in_passing_cdi_annotations_is_found(tmp_path: Path) -> None:
    etc = tmp_path / "etc/containerd"
    (etc / "conf.d").mkdir(parents=True)
    (etc / "config.toml").write_text('version = 2\nimports = ["conf.d/*.toml"]\n')
    (etc / "conf.d/99-gpu.toml").write_text(
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\npod_annotations = ["cdi.k8s.io/*"]\n')
    (line,) = pod_annotation_passthrough(str(tmp_path))
    assert "conf.d/99-gpu.toml" in line


def test_install_hook_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from devinject import cli
    from devinject.runtimes import config as runtime_config

    config = tmp_path / "config.toml"
    config.write_text('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
                      'pod_annotations = ["cdi.k8s.io/*"]\n')
    monkeypatch.setitem(runtime_config.DEFAULT_CONFIG, "containerd", str(config))
    done = CliRunner().invoke(cli.cli, ["install-hook", "--hooks-dir", str(tmp_path / "hooks.d"),
                                        "--server", str(tmp_path / "no.sock")])
    assert done.exit_code == 0, done.output
    assert f"warning: {config}: pod_annotations pass pods' own cdi.k8s.io/ annotations" in done.output
