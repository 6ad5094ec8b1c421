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
