"""The state dir's files each have one owner in nodestate/ (docs/lifecycle.md, "State files"): a record with a
version that reads back what it wrote, and one strict reader whose every refusal is one line naming the file
and the field: a version it does not know, a corrupt file, a truncated one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devinject.nodestate import healthverdicts
from devinject.nodestate.healthverdicts import DeviceVerdict, HealthVerdicts
from devinject.nodestate.statefile import StateFileError

KEY = "nvidia.com/gpu=0000:18:00.0"


def _verdicts() -> HealthVerdicts:
    return HealthVerdicts(("c 195:2",), {KEY: DeviceVerdict("unhealthy", "unhealthy", ("Xid 79",)),
                                         "nvidia.com/gpu=0000:3b:00.0": DeviceVerdict("healthy")}, 12.5)


# --- health.json ---------------------------------------------------------------------------------------------
def test_health_verdicts_read_back_what_was_written(tmp_path: Path) -> None:
    healthverdicts.write(str(tmp_path), _verdicts())
    assert healthverdicts.read(str(tmp_path)) == _verdicts()
    raw = json.loads((tmp_path / "health.json").read_text())
    assert raw["version"] == healthverdicts.VERSION and raw["unhealthy_nodes"] == ["c 195:2"]
    assert os.stat(tmp_path / "health.json").st_mode & 0o777 == 0o644  # every reader may read it


def test_no_health_file_is_no_verdict_and_one_before_versions_reads_as_version_1(tmp_path: Path) -> None:
    assert healthverdicts.read(str(tmp_path)) is None
    (tmp_path / "health.json").write_text(json.dumps({"unhealthy_nodes": ["c 195:0"]}))
    assert healthverdicts.read(str(tmp_path)) == HealthVerdicts(("c 195:0",), {}, 0.0, 1)


@pytest.mark.parametrize(("content", "field"), [
    ('{"version": 2, "unhealthy_nodes": []}', ".version: 2 is not a version this devinject reads (1)"),
    ('{"version": true}', ".version: True is not a version"),
    ('{"unhealthy_nodes": ["c 195', ": not JSON"),  # truncated mid-write by something else than the agent
    ("", ": not JSON"),
    ("\xff\xfe", ": not JSON"),
    ("[]", ": expected an object"),
    ('{"unhealthy_nodes": "c 195:0"}', ".unhealthy_nodes: expected a list of strings"),
    ('{"unhealthy_nodes": [3]}', ".unhealthy_nodes[0]: expected a string"),
    ('{"devices": []}', ".devices: expected an object"),
    (f'{{"devices": {{"{KEY}": {{"published": "fine"}}}}}}',
     f".devices[{KEY!r}].published: expected one of healthy, degraded, unhealthy"),
    (f'{{"devices": {{"{KEY}": {{"published": "healthy", "reasons": "x"}}}}}}',
     f".devices[{KEY!r}].reasons: expected a list of strings"),
    ('{"time": "now"}', ".time: expected a number"),
])
def test_a_health_file_that_cannot_be_believed_is_one_line_naming_the_file_and_field(
        tmp_path: Path, content: str, field: str) -> None:
    (tmp_path / "health.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(StateFileError) as raised:
        healthverdicts.read(str(tmp_path))
    message = raised.value.message
    assert message.startswith(f"{tmp_path}/health.json{field}") and "\n" not in message, message


def test_the_dra_driver_keeps_its_taints_when_health_json_breaks(tmp_path: Path) -> None:
    """It read such a file as "nothing out" before: a device the loop took out went back in the slices."""
    from devinject.dra.driver import read_health

    healthverdicts.write(str(tmp_path), _verdicts())
    health = read_health(str(tmp_path))
    assert health.nodes == {"c 195:2"} and health.reasons == {KEY: ("Xid 79",)}
    (tmp_path / "health.json").write_text('{"unhealthy_nodes": ["c 1')
    with pytest.raises(StateFileError, match=f"^{tmp_path}/health.json: not JSON"):
        read_health(str(tmp_path))

