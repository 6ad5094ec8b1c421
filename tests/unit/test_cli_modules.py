"""The CLI's layout: cli.py assembles one module per command (devinject/commands/), each small, and every
module of it sends the user's stderr lines through `note` (test_cli_help.py's check of cli.py, held for the
modules the commands moved to)."""

from __future__ import annotations

import ast
from pathlib import Path

from devinject import cli, commands

CLI_MODULES = [*sorted(Path(commands.__file__).parent.glob("*.py")), Path(cli.__file__)]
LARGEST = 200  # lines: a command's module is read at once (dra-driver's, with its 30 options, is ~150)


def _stderr_echoes(path: Path) -> list[str]:
    offenders = []
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, ast.FunctionDef) or function.name in ("note", "invoke"):
            continue
        for call in ast.walk(function):
            if (isinstance(call, ast.Call) and ast.unparse(call.func) in ("click.echo", "click.secho", "print")
                    and any(k.arg in ("err", "file") for k in call.keywords)):
                offenders.append(f"{path.name}:{function.name}:{call.lineno}")
    return offenders


def test_every_cli_module_says_to_stderr_through_note() -> None:
    offenders = [line for path in CLI_MODULES for line in _stderr_echoes(path)]
    assert offenders == [], "stderr echoed outside note: " + ", ".join(offenders)


def test_the_check_sees_an_echo_to_stderr(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("import click\n\n\ndef command():\n    click.echo('x', err=True)\n")
    assert _stderr_echoes(module) == ["bad.py:command:5"]


def test_each_command_module_is_small() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in CLI_MODULES}
    assert len(sizes) > 20  # the commands are there, one module each
    assert not {name: size for name, size in sizes.items() if size > LARGEST}, sizes


def _runtime_literals(path: Path, runtimes: set[str]) -> list[str]:
    """Places in `path` that spell two or more runtimes' names in one list, tuple or set."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            named = {e.value for e in node.elts if isinstance(e, ast.Constant)} & runtimes
            if len(named) > 1:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_runtimes_are_listed_once_in_runtimes_names(tmp_path: Path) -> None:
    """`runtime configure --runtime` and `doctor --runtime` take runtimes/names.py's list; no module of the CLI
    spells one of its own (cli.py had it twice, and runtimes/config.py a third copy nobody read)."""
    from devinject.runtimes.names import CONFIGURABLE, RUNTIMES
    from devinject.runtimes.plan import DEFAULT_CONFIG

    configure = cli.cli.commands["runtime"].commands["configure"]  # type: ignore[attr-defined]
    for command in (cli.cli.commands["doctor"], configure):
        (option,) = [p for p in command.params if p.name == "runtime_name"]
        assert tuple(option.type.choices) == RUNTIMES  # type: ignore[attr-defined]
    assert set(DEFAULT_CONFIG) == set(CONFIGURABLE) < set(RUNTIMES)
    assert [line for path in CLI_MODULES for line in _runtime_literals(path, set(RUNTIMES))] == []
    bad = tmp_path / "bad.py"
    bad.write_text('CHOICES = ["containerd", "crio"]\n')
    assert _runtime_literals(bad, set(RUNTIMES)) == ["bad.py:1"]
