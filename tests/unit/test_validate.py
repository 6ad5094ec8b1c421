import pytest

from devinject.specs.validate import validate_paths

GOOD = """---
cdiVersion: 0.5.0
kind: vendor.com/gpu
devices:
- name: '0'
  containerEdits:
    deviceNodes:
    - {path: /dev/gpu0, hostPath: /dev/gpu0, type: c, major: 195, minor: 0}
containerEdits:
  env: [A=1]
"""


def _check(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return validate_paths([str(path)])[1]


def test_good_spec_has_no_problems(tmp_path):
    assert _check(tmp_path, GOOD) == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("type: c, major", "type: c, permissions: rwx, major"),
         "devices[0].containerEdits.deviceNodes[0].permissions"),
        (("env: [A=1]", "env: [NOEQ]"), "containerEdits.env[0]"),
        (("kind: vendor.com/gpu", "kind: vendor.com"), "kind 'vendor.com': expected vendor/class"),
        (("- name: '0'", "- name: '-bad'"), "devices[0].name"),
        (("cdiVersion: 0.5.0", "cdiVersion: 0.4.0"), "needs 0.5.0"),
        (("cdiVersion: 0.5.0", "cdiVersion: 0.9.0"), "cdiVersion: '0.9.0' is not a released CDI version"),
        (("  env: [A=1]", "  env: [A=1]\n  additionalGids: [5]"), "(additionalGids needs 0.7.0)"),
        (("  env: [A=1]", "  hooks: [{hookName: beforeStart, path: /x}]"), "containerEdits.hooks[0].hookName"),
        (("    deviceNodes:", "    unknownThing: 1\n    deviceNodes:"), "unknownThing"),
    ],
    ids=["permissions", "env", "kind", "name", "version-too-low", "version-unknown", "newer-field", "hook-name",
         "unknown-field"],
)
def test_problems_name_file_and_field(tmp_path, edit, message):
    problems = _check(tmp_path, GOOD.replace(*edit))
    assert problems, "expected a problem"
    assert problems[0].startswith(str(tmp_path / "spec.yaml") + ": ")
    assert message in problems[0]


def test_duplicate_device_name_in_one_spec(tmp_path):
    second = "- name: '0'\n  containerEdits:\n    env: [B=2]\ncontainerEdits:\n  env"
    text = GOOD.replace("containerEdits:\n  env", second)
    assert any("defined twice" in p for p in _check(tmp_path, text))


def test_empty_device_edits(tmp_path):
    assert any("empty device edits" in p for p in _check(tmp_path, GOOD.replace(
        "    deviceNodes:\n    - {path: /dev/gpu0, hostPath: /dev/gpu0, type: c, major: 195, minor: 0}\n", "    {}\n")
        .replace("  containerEdits:\n    {}", "  containerEdits: {}")))


def test_same_device_twice_at_same_priority(tmp_path):
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD)
    problems = validate_paths([str(tmp_path)])[1]
    assert any("vendor.com/gpu=0: also defined in" in p for p in problems)


def test_unparseable_file(tmp_path):
    problems = _check(tmp_path, "kind: [unclosed\n")
    assert problems[0].startswith(str(tmp_path / "spec.yaml") + ": invalid YAML")


def _devinject(*args):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([str(Path(sys.executable).parent / "devinject"), *args], capture_output=True, text=True,
                          timeout=60)


BAD_PERMISSIONS = GOOD.replace("type: c, major", "type: c, permissions: rwx, major")
NEWER = GOOD.replace("cdiVersion: 0.5.0", "cdiVersion: 0.7.0").replace("vendor.com/gpu", "vendor.com/npu")


def test_problems_are_typed_with_file_field_message_and_severity(tmp_path):
    from devinject.specs.validate import Problem, check_paths

    (tmp_path / "bad.yaml").write_text(BAD_PERMISSIONS)
    (tmp_path / "newer.yaml").write_text(NEWER)
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    found = check_paths([str(tmp_path)])
    bad, broken, newer = (str(tmp_path / name) for name in ("bad.yaml", "broken.yaml", "newer.yaml"))
    assert found.problems[0] == Problem(bad, "devices[0].containerEdits.deviceNodes[0].permissions",
                                        "only r, w and m are allowed, not 'rwx'")
    assert found.problems[1].file == broken and found.problems[1].field is None
    assert found.problems[1].message.startswith("invalid YAML")
    assert found.problems[2] == Problem(newer, "cdiVersion", "0.7.0: podman 4.x and containerd 1.7 cannot read it "
                                        "(they read up to 0.5.0)", "warning")
    assert len(found.problems) == 3 and found.errors == found.problems[:2] and found.warnings == found.problems[2:]
    assert [f.name for f in found.files if found.valid(f)] == ["newer.yaml"]
    assert str(found.problems[0]) == f"{bad}: devices[0].containerEdits.deviceNodes[0].permissions: only r, w and m " \
                                     "are allowed, not 'rwx'"


def test_a_file_whose_name_holds_a_colon_is_never_called_ok_beside_its_problem(tmp_path):
    """The CLI split each problem line at the first ': ' to find its file: `a: b.yaml`'s problem named file
    `a`, and `a: b.yaml` was printed ok as well."""
    bad = tmp_path / "a: b.yaml"
    bad.write_text(BAD_PERMISSIONS)
    (tmp_path / "good.yaml").write_text(GOOD.replace("vendor.com/gpu", "vendor.com/npu"))
    done = _devinject("validate", str(tmp_path))
    assert done.returncode == 1
    assert done.stdout.splitlines() == [f"ok: {tmp_path / 'good.yaml'}"]
    assert done.stderr.splitlines() == [f"{bad}: devices[0].containerEdits.deviceNodes[0].permissions: only r, w "
                                        "and m are allowed, not 'rwx'"]


def test_validate_json_lists_each_problem_as_an_object(tmp_path):
    import json

    (tmp_path / "bad.yaml").write_text(BAD_PERMISSIONS)
    (tmp_path / "newer.yaml").write_text(NEWER)
    done = _devinject("validate", "--json", str(tmp_path))
    assert done.returncode == 1 and done.stderr == ""
    assert json.loads(done.stdout) == [
        {"file": str(tmp_path / "bad.yaml"), "field": "devices[0].containerEdits.deviceNodes[0].permissions",
         "message": "only r, w and m are allowed, not 'rwx'", "severity": "error"},
        {"file": str(tmp_path / "newer.yaml"), "field": "cdiVersion",
         "message": "0.7.0: podman 4.x and containerd 1.7 cannot read it (they read up to 0.5.0)",
         "severity": "warning"},
    ]
    (tmp_path / "bad.yaml").unlink()
    done = _devinject("validate", "--json", "--max-version", "0.7.0", str(tmp_path))
    assert (done.returncode, json.loads(done.stdout)) == (0, [])


def test_an_untrusted_spec_dir_is_a_problem_of_that_dir(tmp_path):
    from devinject.specs.validate import check_paths

    tmp_path.chmod(0o777)
    (tmp_path / "x.yaml").write_text(GOOD)
    found = check_paths([str(tmp_path)])
    assert found.files == [] and len(found.problems) == 1
    assert (found.problems[0].file, found.problems[0].field) == (str(tmp_path), None)
    assert "its spec files are refused" in found.problems[0].message
