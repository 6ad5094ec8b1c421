"""Golden specs per fixture host: any change to discovery or output shows up as a diff here."""

from pathlib import Path

import pytest

from devinject.specs.generate import GenerateOptions, generate_specs, render, spec_filename
from tests.conftest import GOLDEN, HOST_NAMES, HOSTS

HOOK = "/usr/bin/devinject"


def _rendered(host: str) -> dict[str, str]:
    root = str(HOSTS / host)
    specs = generate_specs(GenerateOptions(root=root, hook_path=HOOK))
    return {spec_filename(s, "yaml"): render(s, "yaml").replace(root, "<ROOT>") for s in specs}


@pytest.mark.parametrize("host", HOST_NAMES)
def test_golden(host: str, update_golden: bool) -> None:
    actual = _rendered(host)
    directory = GOLDEN / host
    if update_golden:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.yaml"):
            old.unlink()
        for name, text in actual.items():
            (directory / name).write_text(text)
        (directory / ".keep").write_text("")
    expected = {p.name: p.read_text() for p in sorted(Path(directory).glob("*.yaml"))}
    assert sorted(actual) == sorted(expected)
    for name, text in actual.items():
        assert text == expected[name], f"{host}/{name} differs from golden (make golden to review)"


def test_empty_vm_emits_nothing():
    assert _rendered("empty-vm") == {}
