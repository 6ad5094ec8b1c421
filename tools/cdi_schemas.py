#!/usr/bin/env python3
"""Write the CDI spec JSON Schemas in schemas/: one per released CDI version (`schemas/cdi-0.5.0.json`
admits exactly the specs that declare `cdiVersion: 0.5.0` and that CDI's reference library loads), and
`schemas/cdi.json`, which picks the version's schema by `cdiVersion`.

The field table below is written from the CDI specification (SPEC.md, specs-go/config.go, the version table
in specs-go/version.go) and from the project's own published schema (schema/schema.json, schema/defs.json),
made strict as the reference's loader is: unknown fields are refused, and a field a version does not define
is refused unless it is empty (the reference's version check asks whether it is used). It does not read
devinject's codec: tests/unit/test_cdi_schemas.py checks that the two agree on the conformance corpus, and
docs/cdi-versions.md lists what a JSON Schema cannot say.

Usage: tools/cdi_schemas.py [--check]   (--check: exit 1 when the files differ from what this writes)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"
DIALECT = "https://json-schema.org/draft/2020-12/schema"

# `$` alone also matches before a final newline in Python's `re` (which Python validators use for
# `pattern`); the lookahead makes every pattern mean the same in ECMA-262 and in Python.
END = r"$(?![\s\S])"
UINT32 = {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}
INT64 = {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1}
# every order of every subset of r, w, m: no other letter, none twice
PERMISSIONS = sorted({"", *"rwm", *(a + b for a in "rwm" for b in "rwm" if a != b),
                      *(a + b + c for a in "rwm" for b in "rwm" for c in "rwm" if len({a, b, c}) == 3)})
HOOK_NAMES = ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def nullable(schema: dict[str, object]) -> dict[str, object]:
    """The reference reads an explicit null as the field's zero value: absent, for every optional field."""
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}  # type: ignore[misc]
    if "type" in schema:
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def strings(item: dict[str, object] | None = None) -> dict[str, object]:
    return nullable({"type": "array", "items": item or {"type": "string"}})


def empty(kind: str) -> dict[str, object]:
    """A field this version does not define: only its empty value (or null) is not a use of it."""
    if kind == "array":
        return {"type": ["array", "null"], "maxItems": 0}
    if kind == "object":
        return {"type": ["object", "null"], "maxProperties": 0}
    return {"enum": ["", None]} if kind == "string" else {"enum": [False, None]}


def segment(middle: str) -> str:
    """A kind's vendor or class (pkg/parser): a letter, then `middle` characters, ending alphanumeric."""
    return rf"[A-Za-z](?:[{middle}]*[A-Za-z0-9])?"


def schema_for(version: str) -> dict[str, object]:
    v = _key(version)
    absolute = {"type": "string", "pattern": "^/"}
    env = strings({"type": "string", "pattern": "^[^=]+="})  # NAME=VALUE, a name before the first '='
    interface = {"type": "string", "minLength": 1, "maxLength": 15, "pattern": rf"^[^/: \t\n]*{END}",
                 "not": {"enum": [".", ".."]}}
    vendor_middle = "A-Za-z0-9_.\\-"
    class_middle = vendor_middle if v >= (0, 6, 0) else "A-Za-z0-9_\\-"  # a '.' in the class: 0.6.0
    name_first = "A-Za-z0-9" if v >= (0, 5, 0) else "A-Za-z"  # a leading digit: 0.5.0
    node = {
        "type": "object",
        "required": ["path"],
        "additionalProperties": False,
        "properties": {
            "path": absolute,
            "hostPath": nullable(absolute) if v >= (0, 5, 0) else {"type": "null"},
            "type": {"enum": ["", "b", "c", "u", "p", None]},
            "major": nullable(INT64),
            "minor": nullable(INT64),
            "fileMode": nullable(UINT32),
            "permissions": {"enum": [*PERMISSIONS, None]},
            "uid": nullable(UINT32),
            "gid": nullable(UINT32),
        },
        # a block or char node gives both numbers or neither (the runtime reads both from the host's node)
        "if": {"required": ["type"], "properties": {"type": {"enum": ["b", "c"]}}},
        "then": {"anyOf": [
            {"required": ["major", "minor"], "properties": {"major": {"type": "integer"},
                                                          "minor": {"type": "integer"}}},
            {"properties": {"major": {"type": "null"}, "minor": {"type": "null"}}},
        ]},
    }
    mount = {
        "type": "object",
        "required": ["hostPath", "containerPath"],
        "additionalProperties": False,
        "properties": {
            "hostPath": {"type": "string", "minLength": 1},
            "containerPath": absolute,
            "options": strings(),
            "type": nullable({"type": "string"}) if v >= (0, 4, 0) else empty("string"),
        },
    }
    hook = {
        "type": "object",
        "required": ["hookName", "path"],
        "additionalProperties": False,
        "properties": {
            "hookName": {"enum": HOOK_NAMES},
            "path": absolute,
            "args": strings(),
            "env": env,
            "timeout": nullable({"type": "integer", "exclusiveMinimum": 0}),
        },
    }
    net_device = {
        "type": "object",
        "required": ["hostInterfaceName", "name"],
        "additionalProperties": False,
        "properties": {"hostInterfaceName": interface, "name": interface},
    }
    rdt_properties: dict[str, object] = {
        # a resctrl class of service: a directory name, or `/`, the root class
        "closID": nullable({"anyOf": [{"const": "/"}, {"type": "string", "maxLength": 4095,
                                                        "pattern": rf"^[^/\n]*{END}", "not": {"enum": [".", ".."]}}]}),
        "l3CacheSchema": nullable({"type": "string"}),
        "memBwSchema": nullable({"type": "string"}),
    }
    if v >= (1, 1, 0):  # 1.1.0 drops enableCMT/enableMBM for enableMonitoring, adds schemata
        rdt_properties.update(enableCMT={"type": "null"}, enableMBM={"type": "null"}, schemata=strings(),
                              enableMonitoring=nullable({"type": "boolean"}))
    else:
        rdt_properties.update(enableCMT=nullable({"type": "boolean"}), enableMBM=nullable({"type": "boolean"}),
                              schemata={"type": "null"}, enableMonitoring=empty("boolean"))
    edits = {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {
            "env": env,
            "deviceNodes": strings({"$ref": "#/$defs/deviceNode"}),
            "mounts": strings({"$ref": "#/$defs/mount"}),
            "hooks": strings({"$ref": "#/$defs/hook"}),
            "netDevices": strings({"$ref": "#/$defs/netDevice"}) if v >= (1, 1, 0) else empty("array"),
            "additionalGids": strings(UINT32) if v >= (0, 7, 0) else empty("array"),
            "intelRdt": (nullable({"type": "object", "additionalProperties": False, "properties": rdt_properties})
                         if v >= (0, 7, 0) else {"type": "null"}),
        },
    }
    used = [{"required": [field], "properties": {field: {"type": "array", "minItems": 1}}}
            for field in ("env", "deviceNodes", "mounts", "hooks", "netDevices", "additionalGids")]
    non_empty = {"type": "object", "anyOf": [*used, {"required": ["intelRdt"],
                                                     "properties": {"intelRdt": {"type": "object"}}}]}
    annotations = (nullable({"type": "object", "additionalProperties": {"type": "string"}})
                   if v >= (0, 6, 0) else empty("object"))
    device = {
        "type": "object",
        "required": ["name", "containerEdits"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "pattern": rf"^[{name_first}](?:[A-Za-z0-9_.:\-]*[A-Za-z0-9])?{END}"},
            "annotations": annotations,
            # CDI refuses a device without edits
            "containerEdits": {"allOf": [{"$ref": "#/$defs/containerEdits"}, non_empty]},
        },
    }
    return {
        "$schema": DIALECT,
        "title": f"CDI spec, cdiVersion {version}",
        "description": f"A Container Device Interface spec that declares cdiVersion {version} (or v{version}) "
                       "and uses only the fields that version defines. Written by devinject "
                       "(tools/cdi_schemas.py); what a schema cannot check is in devinject's docs/cdi-versions.md.",
        "type": "object",
        "required": ["cdiVersion", "kind", "devices"],
        "additionalProperties": False,
        "properties": {
            "cdiVersion": {"enum": [version, f"v{version}"]},
            "kind": {"type": "string", "pattern": f"^{segment(vendor_middle)}/{segment(class_middle)}{END}"},
            "annotations": annotations,
            "devices": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/device"}},
            "containerEdits": {"$ref": "#/$defs/containerEdits"},
        },
        "$defs": {"device": device, "containerEdits": edits, "deviceNode": node, "mount": mount, "hook": hook,
                  "netDevice": net_device},
    }


def dispatcher() -> dict[str, object]:
    return {
        "$schema": DIALECT,
        "title": "CDI spec, any released cdiVersion",
        "description": "Checks a spec against the schema of the version it declares (cdi-<version>.json beside "
                       "this file). Written by devinject (tools/cdi_schemas.py).",
        "type": "object",
        "required": ["cdiVersion"],
        "properties": {"cdiVersion": {"enum": [w for v in VERSIONS for w in (v, f"v{v}")]}},
        "allOf": [{"if": {"properties": {"cdiVersion": {"enum": [v, f"v{v}"]}}},
                   "then": {"$ref": f"cdi-{v}.json"}} for v in VERSIONS],
    }


def rendered() -> dict[str, str]:
    files = {f"cdi-{v}.json": schema_for(v) for v in VERSIONS}
    files["cdi.json"] = dispatcher()
    return {name: json.dumps(schema, indent=2) + "\n" for name, schema in files.items()}


def main(argv: list[str]) -> int:
    stale = []
    for name, text in rendered().items():
        path = SCHEMA_DIR / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            SCHEMA_DIR.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"schemas/ differs from tools/cdi_schemas.py: {', '.join(stale)} (run tools/cdi_schemas.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
