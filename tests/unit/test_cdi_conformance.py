"""CDI as the reference library reads it: every released version and every field it defines is accepted by
`validate` and the hook; what the reference refuses is refused, with messages in words."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from devinject.cdi.cdiversion import KNOWN_VERSIONS, required_version
from devinject.cdi.spec import load_file, spec_from_dict, spec_to_dict
from devinject.hook.registry import Registry
from devinject.specs.validate import check_paths, validate_paths

DEVINJECT = str(Path(sys.executable).parent / "devinject")
NODE = {"path": "/dev/vendor0", "type": "c", "major": 240, "minor": 0, "fileMode": 0o660, "permissions": "rw",
        "uid": 0, "gid": 44}


def edits_for(version: str) -> dict[str, object]:
    """containerEdits using every field `version` defines."""
    v = tuple(int(p) for p in version.split("."))
    node = dict(NODE, **({"hostPath": "/dev/vendor0"} if v >= (0, 5, 0) else {}))
    mount = {"hostPath": "/usr/lib/libvendor.so.1", "containerPath": "/usr/lib/libvendor.so.1",
             "options": ["ro", "nosuid", "nodev", "bind"], **({"type": "bind"} if v >= (0, 4, 0) else {})}
    edits: dict[str, object] = {
        "env": ["VENDOR_VISIBLE=0"], "deviceNodes": [node], "mounts": [mount],
        "hooks": [{"hookName": "createContainer", "path": "/bin/sh", "args": ["vendor-hook", "x"],
                   "env": ["A=1"], "timeout": 5}],
    }
    if v >= (0, 7, 0):
        edits["additionalGids"] = [44, 0]
        rdt: dict[str, object] = {"closID": "gpu", "l3CacheSchema": "L3:0=ff", "memBwSchema": "MB:0=50"}
        if v >= (1, 1, 0):
            rdt.update(schemata=["L2:0=ffff"], enableMonitoring=True)
            edits["netDevices"] = [{"hostInterfaceName": "eth5", "name": "net0"}]
        else:
            rdt.update(enableCMT=True, enableMBM=False)
        edits["intelRdt"] = rdt
    return edits


def spec_for(version: str) -> dict[str, object]:
    v = tuple(int(p) for p in version.split("."))
    spec: dict[str, object] = {"cdiVersion": version, "kind": "vendor.example/acc.v2" if v >= (0, 6, 0)
                               else "vendor.example/acc"}
    device: dict[str, object] = {"name": "0" if v >= (0, 5, 0) else "dev0", "containerEdits": edits_for(version)}
    if v >= (0, 6, 0):
        spec["annotations"] = {"vendor.example/driver": "1.2"}
        device["annotations"] = {"vendor.example/slot": "3"}
    spec["devices"] = [device]
    spec["containerEdits"] = {"env": ["VENDOR=1"]}
    return spec


@pytest.mark.parametrize("version", KNOWN_VERSIONS)
def test_every_released_version_with_every_field_it_defines(tmp_path: Path, version: str) -> None:
    path = tmp_path / "cdi" / "vendor.yaml"
    path.parent.mkdir()
    data = spec_for(version)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    found = check_paths([str(path)])
    assert found.errors == []
    assert bool(found.warnings) == (version not in ("0.3.0", "0.4.0", "0.5.0"))  # old runtimes cannot read it
    spec = load_file(path)
    assert spec_to_dict(spec) == data  # nothing lost: the hook's cache stores exactly this
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))) == spec
    cache = str(tmp_path / "state" / "spec-cache.json")
    for _ in range(2):  # cold (parsed) and warm (from the cache)
        resolved = Registry((str(path.parent),), cache_file=cache).resolve((f"{data['kind']}={spec.devices[0].name}",))
        assert resolved.edits.device_nodes[0].path == "/dev/vendor0"


@pytest.mark.parametrize(("version", "needed"), [
    ("0.3.0", "0.3.0"), ("0.4.0", "0.4.0"), ("0.5.0", "0.5.0"), ("0.6.0", "0.6.0"), ("0.7.0", "0.7.0"),
    ("0.8.0", "0.7.0"), ("1.0.0", "0.7.0"), ("1.1.0", "1.1.0")])
def test_minimum_version_as_the_reference_computes_it(version: str, needed: str) -> None:
    assert required_version(spec_from_dict(spec_for(version))) == needed


def problems_of(tmp_path: Path, data: object) -> list[str]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False) if not isinstance(data, str) else data)
    return [p.split(": ", 1)[1] for p in validate_paths([str(path)])[1]]


# What the reference refuses: a change to spec_for("1.1.0") and the message it gets (test_cdi_schemas.py
# checks the JSON Schemas refuse them too).
REFUSED = [
    (lambda s: s.update(cdiVersion="0.6.0"), "cdiVersion: 0.6.0 is too low for the fields used "
                                             "(netDevices needs 1.1.0)"),
    (lambda s: s["devices"][0]["containerEdits"]["intelRdt"].update(enableCMT=True),
     "devices[0].containerEdits.intelRdt.enableCMT: removed in CDI 1.1.0 (use enableMonitoring)"),
    (lambda s: s.update(devices=[]), "devices: a spec needs at least one device"),
    (lambda s: s["devices"][0].update(containerEdits=None),
     "devices[0].containerEdits: empty device edits (CDI refuses a device without any)"),
    (lambda s: s.update(kind="vendor.com-/device"),
     "kind 'vendor.com-/device': the vendor must end with a letter or digit"),
    (lambda s: s.update(kind="vendor.com/dev!ce"),
     "kind 'vendor.com/dev!ce': the class may contain only letters, digits, '_', '.', '-' (not '!')"),
    (lambda s: s["devices"][0].update(name="-0"),
     "devices[0].name: device name '-0': the name must start with a letter or digit"),
    (lambda s: s["devices"][0]["containerEdits"]["netDevices"][0].update(name="a/b"),
     "devices[0].containerEdits.netDevices[0].name: 'a/b' is not a valid interface name"),
    (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(permissions="rwx"),
     "devices[0].containerEdits.deviceNodes[0].permissions: only r, w and m are allowed, not 'rwx'"),
    (lambda s: s["devices"][0]["containerEdits"]["hooks"][0].update(timeout=0),
     "devices[0].containerEdits.hooks[0].timeout: must be more than 0 seconds"),
    (lambda s: s["devices"][0]["containerEdits"].update(additionalGids=["x"]),
     "devices[0].containerEdits.additionalGids[0]: expected a number, got a string"),
    (lambda s: s["devices"].append(None), "devices[1]: expected a mapping, got nothing"),
    (lambda s: s["devices"][0]["containerEdits"]["intelRdt"].update(closID=5),
     "devices[0].containerEdits.intelRdt.closID: expected a string, got a number"),
    (lambda s: s.update(extra=1), "extra: unknown field (known here: cdiVersion, kind, annotations, devices, "
                                  "containerEdits)"),
]


@pytest.mark.parametrize(("change", "message"), REFUSED)
def test_what_the_reference_refuses_is_refused_in_words(tmp_path: Path, change, message: str) -> None:
    data = spec_for("1.1.0")
    change(data)
    problems = problems_of(tmp_path, data)
    assert message in problems, problems
    assert not any("None" in p or "NoneType" in p for p in problems)


EMPTY_SPEC_EDITS = ("cdiVersion: 0.5.0\nkind: vendor.example/acc\ncontainerEdits:\ndevices:\n- name: '0'\n"
                    "  containerEdits:\n    deviceNodes: [{path: /dev/vendor0}]\n")


def test_an_empty_spec_level_container_edits_is_no_edits(tmp_path: Path) -> None:
    text = EMPTY_SPEC_EDITS
    assert problems_of(tmp_path, text) == []
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "x.yaml").write_text(text)
    assert Registry((str(tmp_path / "cdi"),)).resolve(("vendor.example/acc=0",)).names


def test_validate_cli_warns_about_old_runtimes_and_max_version_refuses(tmp_path: Path) -> None:
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(spec_for("0.7.0"), sort_keys=False))
    done = subprocess.run([DEVINJECT, "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (f"warning: {path}: cdiVersion: 0.7.0: podman 4.x and containerd 1.7 cannot "
                                   "read it (they read up to 0.5.0)")
    refused = subprocess.run([DEVINJECT, "validate", "--max-version", "0.5.0", str(path)], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"{path}: cdiVersion: 0.7.0 is above the allowed 0.5.0"
    assert subprocess.run([DEVINJECT, "validate", "--max-version", "0.7.0", str(path)], capture_output=True,
                          text=True, timeout=60).returncode == 0
    bad = subprocess.run([DEVINJECT, "validate", "--max-version", "2.0", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--max-version: '2.0' is not a released CDI version" in bad.stderr


@pytest.mark.parametrize("version", KNOWN_VERSIONS)
def test_a_v_prefix_on_cdi_version_reads_as_the_reference_reads_it(tmp_path: Path, version: str) -> None:
    """specs-go/version.go: newVersion trims one leading `v`, so `v1.1.0` is 1.1.0 there; the checks that hang
    on the version (what it admits, what 1.1.0 removed, who cannot read it) see the same version here."""
    path = tmp_path / "cdi" / "vendor.yaml"
    path.parent.mkdir()
    data = {**spec_for(version), "cdiVersion": f"v{version}"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    found = check_paths([str(path)])
    assert found.errors == []
    assert bool(found.warnings) == (version not in ("0.3.0", "0.4.0", "0.5.0"))
    resolved = Registry((str(path.parent),)).resolve((f"{data['kind']}={data['devices'][0]['name']}",))  # type: ignore[index]
    assert resolved.edits.device_nodes[0].path == "/dev/vendor0"


PREFIXED = [
    ("vv1.1.0", "cdiVersion: 'vv1.1.0' is not a released CDI version"),
    ("V1.1.0", "cdiVersion: 'V1.1.0' is not a released CDI version"),
    ("v0.6.0", "cdiVersion: v0.6.0 is too low for the fields used (netDevices needs 1.1.0)"),
]


@pytest.mark.parametrize(("written", "message"), PREFIXED)
def test_a_prefixed_version_is_still_checked(tmp_path: Path, written: str, message: str) -> None:
    problems = problems_of(tmp_path, {**spec_for("1.1.0"), "cdiVersion": written})
    assert any(p.startswith(message) for p in problems), problems


def test_removed_intel_rdt_fields_are_refused_under_a_prefixed_version_too(tmp_path: Path) -> None:
    data = {**spec_for("1.1.0"), "cdiVersion": "v1.1.0"}
    data["devices"][0]["containerEdits"]["intelRdt"]["enableCMT"] = True  # type: ignore[index]
    assert ("devices[0].containerEdits.intelRdt.enableCMT: removed in CDI 1.1.0 (use enableMonitoring)"
            in problems_of(tmp_path, data))


CLOS_IDS = [
    ("/", True),  # the root class of service (container-edits.go: `case c == "/":`)
    ("gpu", True), ("a" * 4095, True),
    ("a" * 4096, False), (".", False), ("..", False), ("a/b", False), ("//", False), ("a\nb", False),
]


@pytest.mark.parametrize(("clos_id", "valid"), CLOS_IDS, ids=[
    "root", "name", "longest", "too-long", "dot", "dotdot", "slash", "two-slashes", "newline"])
def test_clos_id_as_the_reference_checks_it(tmp_path: Path, clos_id: str, valid: bool) -> None:
    data = spec_for("1.1.0")
    data["devices"][0]["containerEdits"]["intelRdt"]["closID"] = clos_id  # type: ignore[index]
    problems = [p for p in problems_of(tmp_path, data) if "closID" in p]
    assert problems == ([] if valid else [
        f"devices[0].containerEdits.intelRdt.closID: {clos_id!r} is not a valid class of service name"])
