"""schemas/profile.json is the profile parser's contract: every shipped and test profile validates, every
profile the parser refuses is refused by the schema too (or is one of the rules docs/profiles.md says a
schema cannot express), and the schema, the parser and docs/profiles.md know the same keys."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from devinject.core.errors import ConfigError
from devinject.discovery.profiles import parse_profile
from tests.unit.test_profiles import ADMIN_PROFILE

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "schemas/profile.json").read_text())
VALIDATOR = Draft202012Validator(SCHEMA)
SHIPPED = sorted((REPO / "src/devinject/data/profiles").glob("*.yaml"))
HEAD = "name: x\nkind: a.com/b\n"


def parser_accepts(data: object) -> bool:
    try:
        parse_profile(data, "x.yaml")
    except ConfigError:
        return False
    return True


ACCEPTED = [
    ("admin-profile", ADMIN_PROFILE),
    ("minimal", HEAD),
    ("empty-values-are-not-given", HEAD + "description:\nvendor-name:\npriority:\ndriver-libraries:\n"
                                         "partitions:\nforward-compat:\napplication-profile:\nchannels:\n"
                                         "uuid: {proc-file: , key: }\n"),
    ("single-strings", HEAD + "libraries: libx.so.1\nmatch: {vendor: 10de, class: '0302', driver: nvidia}\n"),
    ("node-rule-every-source", HEAD + "device-nodes:\n- {class: drm, names: card*}\n"
                                      "- {proc-file: '/proc/x/{address}', proc-key: Minor, path: '/dev/x{minor}'}\n"
                                      "- {sysfs: '/sys/class/*/x{index}', optional: true}\n- {iommu-group: true}\n"
                                      "- {path: /dev/xctl, minor: 255, major: 195}\n"
                                      "- {path: /dev/y, minor: 1, region: y}\n"
                                      "- {sysfs: /sys/class/misc/z, path: /dev/z}\n"),
    ("kernel-log", HEAD + "health: {kernel-log: {pattern: '(?P<slot>x)(?P<code>y)', fatal: [1]}, flags: []}\n"),
    ("links-and-files", HEAD + "links: {libx.so: libx.so.1, gbm/x.so: 'liby.so.{driver_version}'}\n"
                               "config-files: [{container: /etc/x.json}]\n"
                               "driver-libraries: {anchor: libx.so.1, patterns: '*.so.1', subdirs: [vdpau/a]}\n"),
    ("channels-without-match", HEAD + "channels: {directory: /dev/x-channels/, prefix: channel, region: x}\n"),
    ("channels-with-empty-match", HEAD + "match: {}\nchannels: {directory: /dev/x, prefix: c, region: x}\n"),
    ("models-unquoted-keys", HEAD + "models: {1020: Acme, d100: Other}\n"),
]

# Every refusal of the parser (each `raise ConfigError` in discovery/profiles.py that reads a profile).
REFUSED = [
    ("not-a-mapping", "- a\n"),
    ("unknown-field", HEAD + "bogus: 1\n"),
    ("no-name", "kind: a.com/b\n"),
    ("null-name", "name:\nkind: a.com/b\n"),
    ("name-a-number", "name: 5\nkind: a.com/b\n"),
    ("kind-without-class", "name: x\nkind: bad\n"),
    ("kind-vendor-ends-badly", "name: x\nkind: a.com-/b\n"),
    ("kind-final-newline", 'name: x\nkind: "a.com/b\\n"\n'),
    ("priority-a-string", HEAD + "priority: high\n"),
    ("priority-a-bool", HEAD + "priority: true\n"),
    ("group-by-unknown", HEAD + "group-by: card\n"),
    ("group-by-null", HEAD + "group-by:\n"),
    ("sharing-unknown", HEAD + "sharing: sometimes\n"),
    ("flag-a-string", HEAD + "uuid: {nvml: 'yes'}\n"),
    ("strings-a-number", HEAD + "libraries: [1]\n"),
    ("strings-a-mapping", HEAD + "binaries: {a: b}\n"),
    ("strings-null", HEAD + "files:\n"),
    ("vendor-not-hex", HEAD + "match: {vendor: [zz]}\n"),
    ("match-null", HEAD + "match:\n"),
    ("match-unknown-key", HEAD + "match: {device: ['1']}\n"),
    ("nodes-not-a-list", HEAD + "device-nodes: {class: drm}\n"),
    ("node-two-sources", HEAD + "device-nodes: [{class: drm, sysfs: /x}]\n"),
    ("node-no-source", HEAD + "device-nodes: [{names: [x]}]\n"),
    ("node-proc-file-without-key", HEAD + "device-nodes: [{proc-file: /proc/x, path: /dev/x}]\n"),
    ("node-fixed-path-without-minor", HEAD + "shared-nodes: [{path: /dev/x, major: 1}]\n"),
    ("node-fixed-path-without-major", HEAD + "shared-nodes: [{path: /dev/x, minor: 1}]\n"),
    ("node-iommu-null", HEAD + "device-nodes: [{iommu-group: }]\n"),
    ("mount-options-a-list", HEAD + "mount-options: [rw]\n"),
    ("mount-options-relative", HEAD + "mount-options: {run/x: [rw, bind]}\n"),
    ("mount-options-not-a-list", HEAD + "mount-options: {/run/x: rw}\n"),
    ("mount-options-unknown", HEAD + "mount-options: {/run/x: [rw, bind, sticky]}\n"),
    ("mount-options-no-bind", HEAD + "mount-options: {/run/x: [rw]}\n"),
    ("health-null", HEAD + "health:\n"),
    ("health-flags-not-a-list", HEAD + "health: {flags: {a: b}}\n"),
    ("health-flag-without-key", HEAD + "health: {flags: [{proc-file: /p, unhealthy: 'Yes'}]}\n"),
    ("kernel-log-without-pattern", HEAD + "health: {kernel-log: {name: X}}\n"),
    ("kernel-log-without-groups", HEAD + "health: {kernel-log: {pattern: 'error (\\d+)'}}\n"),
    ("kernel-log-not-a-regex", HEAD + "health: {kernel-log: {pattern: '(?P<slot>x)(?P<code>[y'}}\n"),
    ("kernel-log-fatal-bools", HEAD + "health: {kernel-log: {pattern: '(?P<slot>x)(?P<code>y)', fatal: [true]}}\n"),
    ("driver-libraries-without-patterns", HEAD + "driver-libraries: {anchor: libx.so.1}\n"),
    ("driver-libraries-empty-patterns", HEAD + "driver-libraries: {anchor: libx.so.1, patterns: []}\n"),
    ("driver-libraries-without-anchor", HEAD + "driver-libraries: {patterns: ['*.so']}\n"),
    ("driver-libraries-path-pattern", HEAD + "driver-libraries: {anchor: l, patterns: ['a/*.so']}\n"),
    ("driver-libraries-path-exclude", HEAD + "driver-libraries: {anchor: l, patterns: ['*'], exclude: [a/b]}\n"),
    ("driver-libraries-absolute-subdir", HEAD + "driver-libraries: {anchor: l, patterns: ['*'], subdirs: [/a]}\n"),
    ("driver-libraries-dotdot-subdir", HEAD + "driver-libraries: {anchor: l, patterns: ['*'], subdirs: [a/..]}\n"),
    ("links-a-list", HEAD + "links: [a]\n"),
    ("links-target-a-path", HEAD + "links: {libx.so: lib/libx.so.1}\n"),
    ("links-absolute", HEAD + "links: {/lib/libx.so: libx.so.1}\n"),
    ("links-dotdot", HEAD + "links: {../libx.so: libx.so.1}\n"),
    ("links-dot-segment", HEAD + "links: {a/./libx.so: libx.so.1}\n"),
    ("links-empty-segment", HEAD + "links: {a//libx.so: libx.so.1}\n"),
    ("links-empty-target", HEAD + "links: {libx.so: ''}\n"),
    ("forward-compat-relative", HEAD + "forward-compat: {directory: compat, library: libx.so}\n"),
    ("forward-compat-colon", HEAD + "forward-compat: {directory: '/a:b', library: libx.so}\n"),
    ("forward-compat-library-path", HEAD + "forward-compat: {directory: /c, library: a/libx.so}\n"),
    ("forward-compat-without-library", HEAD + "forward-compat: {directory: /c}\n"),
    ("application-profile-node-outside-dev", HEAD + "application-profile: {gpu-node: '/x{minor}', needs: [/a]}\n"),
    ("application-profile-node-without-minor", HEAD + "application-profile: {gpu-node: /dev/x0, needs: [/a]}\n"),
    ("application-profile-node-minor-twice", HEAD + "application-profile: {gpu-node: '/dev/x{minor}{minor}', "
                                                    "needs: [/a]}\n"),
    ("application-profile-needs-nothing", HEAD + "application-profile: {gpu-node: '/dev/x{minor}', needs: []}\n"),
    ("application-profile-relative-need", HEAD + "application-profile: {gpu-node: '/dev/x{minor}', needs: [a]}\n"),
    ("channels-with-match", HEAD + "match: {vendor: ['10de']}\nchannels: {directory: /dev/x, prefix: c, region: x}\n"),
    ("channels-outside-dev", HEAD + "channels: {directory: /run/x, prefix: c, region: x}\n"),
    ("channels-without-prefix", HEAD + "channels: {directory: /dev/x, region: x}\n"),
    ("partitions-unknown-type", HEAD + "partitions: {type: amd-xcp, source: /p, node: '/dev/x{minor}', region: r}\n"),
    ("partitions-node-without-minor", HEAD + "partitions: {type: amd-kfd, source: /p, node: /dev/x, region: r}\n"),
    ("partitions-node-outside-dev", HEAD + "partitions: {type: amd-kfd, source: /p, node: '/x{minor}', region: r}\n"),
    ("config-files-a-mapping", HEAD + "config-files: {container: /etc/x}\n"),
    ("config-files-relative", HEAD + "config-files: [{container: etc/x.json}]\n"),
    ("config-files-relative-host", HEAD + "config-files: [{container: /etc/x.json, host: [x.json]}]\n"),
    ("models-a-list", HEAD + "models: [a]\n"),
    ("models-not-hex", HEAD + "models: {zz: Acme}\n"),
    ("env-without-equals", HEAD + "env: [NOEQUALS]\n"),
    ("env-only-equals", HEAD + "env: ['=1']\n"),
]

# The parser checks what a JSON Schema cannot (docs/profiles.md, "The schema"): (parser, schema) answers.
SCHEMA_CANNOT = {"kernel-log-not-a-regex": (False, True)}

# What the parser lets through and the schema, the contract, does not (docs/profiles.md, "The schema").
PARSER_LAXER = [
    ("hex-id-with-spaces", HEAD + "match: {vendor: [' 10de']}\n"),
    ("hex-id-with-underscores", HEAD + "models: {'10_20': Acme}\n"),
    ("model-name-a-number", HEAD + "models: {'1020': 5}\n"),
]


def _load(text: str) -> object:
    return yaml.safe_load(text)


def test_every_shipped_profile_validates():
    assert len(SHIPPED) >= 10
    for path in SHIPPED:
        errors = [f"{e.json_path}: {e.message}" for e in VALIDATOR.iter_errors(_load(path.read_text()))]
        assert errors == [], path.name


@pytest.mark.parametrize(("case_id", "text"), ACCEPTED, ids=[c for c, _ in ACCEPTED])
def test_what_the_parser_accepts_validates(case_id: str, text: str) -> None:
    data = _load(text)
    assert parser_accepts(data)
    assert [f"{e.json_path}: {e.message}" for e in VALIDATOR.iter_errors(data)] == []


@pytest.mark.parametrize(("case_id", "text"), REFUSED, ids=[c for c, _ in REFUSED])
def test_what_the_parser_refuses_the_schema_refuses(case_id: str, text: str) -> None:
    data = _load(text)
    answers = (parser_accepts(data), VALIDATOR.is_valid(data))
    assert answers == SCHEMA_CANNOT.get(case_id, (False, False))


@pytest.mark.parametrize(("case_id", "text"), PARSER_LAXER, ids=[c for c, _ in PARSER_LAXER])
def test_where_the_parser_is_laxer_than_the_schema(case_id: str, text: str) -> None:
    data = _load(text)
    assert (parser_accepts(data), VALIDATOR.is_valid(data)) == (True, False)


def _parser_key_sets() -> list[set[str]]:
    """The key sets the parser allows, one per mapping it reads (`_Fields(data, where, {...})`)."""
    tree = ast.parse((REPO / "src/devinject/discovery/profiles.py").read_text())
    return [{elt.value for elt in node.args[2].elts}  # type: ignore[attr-defined]
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_Fields"
            and len(node.args) == 3 and isinstance(node.args[2], ast.Set)]


def _schema_key_sets(schema: object) -> list[set[str]]:
    found = []
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict) and schema.get("additionalProperties") is False:
            found.append(set(schema["properties"]))
        for value in schema.values():
            found += _schema_key_sets(value)
    elif isinstance(schema, list):
        for value in schema:
            found += _schema_key_sets(value)
    return found


def test_the_schema_knows_every_key_the_parser_reads():
    parser_sets = _parser_key_sets()
    assert len(parser_sets) >= 10, "the parser no longer reads mappings with _Fields: update this test"
    schema_sets = _schema_key_sets(SCHEMA)
    assert [keys for keys in parser_sets if keys not in schema_sets] == []


def test_docs_profiles_example_names_every_top_level_key():
    text = (REPO / "docs/profiles.md").read_text()
    example = text.split("```yaml", 1)[1].split("```", 1)[0]
    documented = set(re.findall(r"^([a-z][a-z-]*):", example, re.M))
    assert documented == set(SCHEMA["properties"]) - {"description"}
    assert "schemas/profile.json" in text
