"""The watch loop's publishers (agent/publishers.py): a new consumer of a round is one object appended to
`publishers`, told after the node's files in order (the specs written, health.json written) with the
round's result, and the loop's health.json is written by one function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import devinject.agent.publishers as publishers
from devinject.agent.publishers import HealthFile, Round, SpecFiles
from devinject.agent.watch import Watcher
from tests.unit.test_watch import options


def test_an_appended_publisher_is_told_after_the_node_s_files(host_copy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    watcher = Watcher(options(host_copy("hgx-h100"), tmp_path))
    seen: list[tuple[list[str], bool, frozenset[str]]] = []

    def publisher(result: Round) -> None:
        health = json.loads((tmp_path / "state" / "health.json").read_text())
        seen.append(([s.kind for s in result.specs], "devices" in health, result.unhealthy()))

    watcher.publishers.append(publisher)
    assert [type(p) for p in watcher.publishers[:2]] == [SpecFiles, HealthFile]
    watcher.rescan()
    watcher.check()
    assert watcher.write() == watcher.generation is not None
    assert seen == [(["nvidia.com/rdma", "nvidia.com/gpu"], True, frozenset())]
    assert (tmp_path / "cdi" / "nvidia.com-gpu.yaml").exists()


def test_without_specs_the_loop_publishes_health_json_alone(host_copy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    watcher = Watcher(replace(options(host_copy("hgx-h100"), tmp_path), specs=False))
    assert [type(p) for p in watcher.publishers] == [HealthFile]
    watcher.rescan()
    watcher.check()
    assert watcher.write() is None and watcher.specs == []
    assert not (tmp_path / "cdi").exists() and (tmp_path / "state" / "health.json").exists()


def test_health_json_is_written_by_one_function(host_copy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Every write of health.json goes through `write_health_file` (the write with the specs, and the one
    after a round whose verdicts changed)."""
    from devinject.core import atomicfile

    calls: list[list[str]] = []
    inside: list[bool] = []  # whether write_health_file is on the stack
    real = publishers.write_health_file

    def counted(state_dir: str, nodes: list[str], devices: dict[str, object]) -> None:
        calls.append(nodes)
        inside.append(True)
        try:
            real(state_dir, nodes, devices)  # type: ignore[arg-type]
        finally:
            inside.pop()

    real_replace = atomicfile.replace
    writes_outside: list[str] = []

    def watched_replace(path: str, *args: object, **kwargs: object) -> object:
        if path.endswith("health.json") and not inside:
            writes_outside.append(path)  # a second writer of health.json, beside the one function
        return real_replace(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(publishers, "write_health_file", counted)
    monkeypatch.setattr(atomicfile, "replace", watched_replace)
    root = host_copy("hgx-h100")
    watcher = Watcher(options(root, tmp_path))
    watcher.rescan()
    watcher.check()
    watcher.write()
    assert len(calls) == 1
    health = tmp_path / "state" / "health.json"
    health.unlink()
    watcher.check()  # nothing changed: not written again
    assert not health.exists() and len(calls) == 1
    assert writes_outside == []
