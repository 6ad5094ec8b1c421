"""schemas/cdi-*.json and devinject's codec agree on every case of the CDI conformance corpus
(test_cdi_conformance.py) and on the corners below; where they cannot, the difference is the one
docs/cdi-versions.md names, and this test fails when it goes away."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from devinject.cdi.cdiversion import KNOWN_VERSIONS
from devinject.cdi.spec import spec_from_dict
from devinject.cdi.specrules import spec_problems
from devinject.core.errors import SpecError
from tests.unit.test_cdi_conformance import CLOS_IDS, EMPTY_SPEC_EDITS, PREFIXED, REFUSED, spec_for

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas"


def _validator() -> Draft202012Validator:
    resources = [(path.name, Resource.from_contents(json.loads(path.read_text())))
                 for path in SCHEMAS.glob("cdi-*.json")]
    registry: Registry = Registry().with_resources(resources)
    return Draft202012Validator(json.loads((SCHEMAS / "cdi.json").read_text()), registry=registry)


VALIDATOR = _validator()


def codec_accepts(data: object) -> bool:
    try:
        spec = spec_from_dict(data)
    except SpecError:
        return False
    return spec_problems(spec) == []


def schema_accepts(data: object) -> bool:
    return VALIDATOR.is_valid(data)


def changed(change) -> dict:
    data = spec_for("1.1.0")
    change(data)
    return data


def lowered(version: str, to: str) -> dict:
    return {**spec_for(version), "cdiVersion": to}


def with_clos_id(clos_id: str) -> dict:
    data = spec_for("1.1.0")
    data["devices"][0]["containerEdits"]["intelRdt"]["closID"] = clos_id  # type: ignore[index]
    return data


def edited(version: str, **edits: object) -> dict:
    data = spec_for(version)
    data["devices"][0]["containerEdits"].update(edits)  # type: ignore[index]
    return data


def node(version: str, **fields: object) -> dict:
    data = spec_for(version)
    data["devices"][0]["containerEdits"]["deviceNodes"][0].update(fields)  # type: ignore[index]
    return data


def removed_rdt_field() -> dict:
    data = {**spec_for("1.1.0"), "cdiVersion": "v1.1.0"}
    data["devices"][0]["containerEdits"]["intelRdt"]["enableCMT"] = True  # type: ignore[index]
    return data


def twice(data: dict) -> dict:
    data["devices"].append(copy.deepcopy(data["devices"][0]))
    return data


CORPUS: list[tuple[str, object]] = [
    *((f"every-field-{v}", spec_for(v)) for v in KNOWN_VERSIONS),
    *((f"v-prefix-{v}", {**spec_for(v), "cdiVersion": f"v{v}"}) for v in KNOWN_VERSIONS),
    *((f"{v}-declared-as-{lower}", lowered(v, lower)) for v in KNOWN_VERSIONS for lower in KNOWN_VERSIONS
      if KNOWN_VERSIONS.index(lower) < KNOWN_VERSIONS.index(v)),
    *((f"refused-{i}-{message.split(':')[0]}", changed(change)) for i, (change, message) in enumerate(REFUSED)),
    *((f"prefixed-{written}", {**spec_for("1.1.0"), "cdiVersion": written}) for written, _ in PREFIXED),
    ("removed-rdt-field-under-v1.1.0", removed_rdt_field()),
    *((f"closID-{clos_id[:8]!r}-{len(clos_id)}", with_clos_id(clos_id)) for clos_id, _ in CLOS_IDS),
    ("empty-spec-level-edits", yaml.safe_load(EMPTY_SPEC_EDITS)),
    # corners of the same rules
    ("unreleased-version", {**spec_for("0.3.0"), "cdiVersion": "0.9.0"}),
    ("kind-with-a-final-newline", {**spec_for("0.3.0"), "kind": "vendor.example/acc\n"}),
    ("dot-in-class-at-0.5.0", {**spec_for("0.5.0"), "kind": "vendor.example/acc.v2"}),
    ("digit-name-at-0.4.0", {**spec_for("0.4.0"), "devices": [{"name": "0", "containerEdits": {"env": ["A=1"]}}]}),
    ("empty-mount-type-at-0.3.0", edited("0.3.0", mounts=[{"hostPath": "/a", "containerPath": "/a", "type": ""}])),
    ("empty-new-lists-at-0.3.0", edited("0.3.0", netDevices=[], additionalGids=[], intelRdt=None)),
    ("empty-annotations-at-0.5.0", {**spec_for("0.5.0"), "annotations": {}}),
    ("nulls-for-optional-fields", node("0.5.0", hostPath=None, uid=None, permissions=None)),
    ("null-removed-rdt-field-under-1.1.0", edited("1.1.0", intelRdt={"closID": "gpu", "enableCMT": None})),
    ("char-node-with-major-only", node("0.3.0", minor=None)),
    ("char-node-with-neither-number", node("0.3.0", major=None, minor=None)),
    ("fifo-with-major-only", node("0.3.0", type="p", minor=None)),
    ("permissions-mr", node("0.3.0", permissions="mr")),
    ("permissions-rr", node("0.3.0", permissions="rr")),
    ("uid-above-uint32", node("0.3.0", uid=1 << 32)),
    ("major-a-bool", node("0.3.0", major=True)),
    ("env-without-a-name", edited("0.3.0", env=["=1"])),
    ("device-edits-with-empty-lists-only", edited("0.3.0", env=[], deviceNodes=[], mounts=[], hooks=[])),
    ("interface-name-16-characters", edited("1.1.0", netDevices=[{"hostInterfaceName": "e" * 16, "name": "n"}])),
    ("interface-name-dotdot", edited("1.1.0", netDevices=[{"hostInterfaceName": "..", "name": "n"}])),
    ("hook-timeout-negative", {**spec_for("0.3.0"), "containerEdits": {"hooks": [
        {"hookName": "poststop", "path": "/bin/true", "timeout": -1}]}}),
    ("not-a-mapping", ["cdiVersion", "0.3.0"]),
    ("relative-node-path", node("1.1.0", path="dev/vendor0")),
    ("relative-node-host-path", node("1.1.0", hostPath="dev/vendor0")),
    ("unknown-node-field", node("1.1.0", devicePath="/dev/vendor0")),
    ("block-node", node("1.1.0", type="b")),
    ("node-type-x", node("1.1.0", type="x")),
    ("relative-container-path", edited("1.1.0", mounts=[{"hostPath": "/a", "containerPath": "a"}])),
    ("empty-mount-host-path", edited("1.1.0", mounts=[{"hostPath": "", "containerPath": "/a"}])),
    ("unknown-hook-name", edited("1.1.0", hooks=[{"hookName": "prestop", "path": "/bin/true"}])),
    ("relative-hook-path", edited("1.1.0", hooks=[{"hookName": "poststop", "path": "true"}])),
    ("intel-rdt-unknown-field", edited("1.1.0", intelRdt={"closID": "gpu", "enableCAT": True})),
    ("additional-gid-negative", edited("1.1.0", additionalGids=[-1])),
    ("device-name-twice", twice(spec_for("0.5.0"))),
    ("interface-name-twice", edited("1.1.0", netDevices=[{"hostInterfaceName": "eth5", "name": "net0"},
                                                         {"hostInterfaceName": "eth6", "name": "net0"}])),
    ("major-as-a-decimal-number", node("0.3.0", major=240.0)),
]

# Where a JSON Schema cannot say what the reference checks (docs/cdi-versions.md, "The JSON Schemas"):
# (the codec's answer, the schemas' answer).
DIFFERENCES = {
    "device-name-twice": (False, True),  # uniqueness of one field among list items
    "interface-name-twice": (False, True),
    "major-as-a-decimal-number": (False, True),  # JSON Schema's integer is any number with no fraction
}


def test_the_corpus_has_both_answers_and_unique_ids():
    ids = [case_id for case_id, _ in CORPUS]
    assert len(ids) == len(set(ids))
    answers = {codec_accepts(data) for _, data in CORPUS}
    assert answers == {True, False}


@pytest.mark.parametrize(("case_id", "data"), CORPUS, ids=[case_id for case_id, _ in CORPUS])
def test_the_schema_and_the_codec_agree(case_id: str, data: object) -> None:
    answers = (codec_accepts(data), schema_accepts(data))
    expected = DIFFERENCES.get(case_id)
    if expected is not None:
        assert answers == expected, "a documented difference is gone: update docs/cdi-versions.md"
    else:
        problems = [e.message for e in VALIDATOR.iter_errors(data)][:3]
        assert answers[0] == answers[1], f"codec {'accepts' if answers[0] else 'refuses'}, schema {problems}"


@pytest.mark.parametrize("version", KNOWN_VERSIONS)
def test_a_version_schema_admits_only_its_own_version(version: str) -> None:
    schema = json.loads((SCHEMAS / f"cdi-{version}.json").read_text())
    Draft202012Validator.check_schema(schema)
    single = Draft202012Validator(schema)
    assert single.is_valid(spec_for(version))
    later = [v for v in KNOWN_VERSIONS if KNOWN_VERSIONS.index(v) > KNOWN_VERSIONS.index(version)]
    assert all(not single.is_valid(spec_for(v)) for v in later)


def test_the_schema_files_are_what_the_tool_writes():
    done = subprocess.run([sys.executable, str(REPO / "tools/cdi_schemas.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_tool_knows_every_version_the_codec_reads():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import cdi_schemas
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert cdi_schemas.VERSIONS == KNOWN_VERSIONS
    assert sorted(p.name for p in SCHEMAS.glob("cdi-*.json")) == sorted(f"cdi-{v}.json" for v in KNOWN_VERSIONS)
