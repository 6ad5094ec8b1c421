"""The command line's edges as a user meets them: -q is errors only, `--help` lists every command and every
option says what it does, each cdi-hook subcommand's --help names every flag the generated specs use, and a
malformed --config file is one line naming its file, line and column."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from devinject import cli, entry
from tests.conftest import HOSTS

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def run(*args, stdin=None):
    return subprocess.run([DEVINJECT, *args], capture_output=True, text=True, input=stdin, timeout=60)


def said_to_the_user(tmp_path):
    """Invocations that succeed and say something on stderr that is not an error."""
    empty = HOSTS / "empty-vm"
    (tmp_path / "no-specs").mkdir(parents=True)
    shutil.copytree(HOSTS / "hgx-h100", tmp_path / "hgx-h100", symlinks=True)  # its /dev/char links are missing
    return [
        ("generate", "--root", str(HOSTS / "gaudi2"), "--hook-path", "/usr/bin/devinject", "--output-dir",
         str(tmp_path / "cdi")),
        ("generate", "--root", str(HOSTS / "gaudi2"), "--hook-path", "/usr/bin/devinject", "--output",
         str(tmp_path / "one.yaml")),
        ("install-hook", "--hooks-dir", str(tmp_path / "hooks.d"), "--executable", DEVINJECT, "--server",
         str(tmp_path / "nobody.sock")),
        ("install-hook", "--runc-snippet", "--server-unit", "--unit-dir", str(tmp_path / "units")),
        ("create-dev-char-links", "--root", str(tmp_path / "hgx-h100")),
        ("list", "--root", str(empty), "--state-dir", str(tmp_path / "state")),
        ("topo", "--root", str(empty)),
        ("health", "--root", str(empty)),
        ("events", "--state-dir", str(tmp_path / "state")),
        ("validate", str(tmp_path / "no-specs")),
    ]


def test_quiet_means_errors_only_on_every_command(tmp_path):
    """Each invocation says something without -q (so the check can fail) and nothing at all with it."""
    for args in said_to_the_user(tmp_path / "loud"):
        done = run(*args)
        assert done.returncode == 0 and done.stderr, (args, done.stderr)
    for args in said_to_the_user(tmp_path / "quiet"):
        done = run("-q", *args)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
    done = run("-q", "generate", "--root", "/nonexistent/root", "--output", "-")
    assert done.returncode == 2 and done.stderr.startswith("devinject: error: --root")  # errors stay (usage: 2)


def test_one_place_decides_what_reaches_stderr():
    """Every non-error line on stderr goes through cli.note, which -q silences: no command echoes to stderr
    itself (the error handler aside), so a new message cannot forget -q."""
    tree = ast.parse(Path(cli.__file__).read_text())
    allowed = {"note", "invoke"}
    offenders = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or function.name in allowed:
            continue
        for call in ast.walk(function):
            if (isinstance(call, ast.Call) and ast.unparse(call.func) in ("click.echo", "click.secho", "print")
                    and any(k.arg in ("err", "file") for k in call.keywords)):
                offenders.append(f"{function.name}:{call.lineno}")
    assert offenders == [], "stderr echoed outside cli.note: " + ", ".join(offenders)


def _listed_commands(help_text):
    section = help_text.split("\nCommands:\n", 1)[1]
    return {line.split()[0] for line in section.splitlines() if line.startswith("  ") and line.strip()}


def test_help_lists_every_command_a_user_can_run():
    done = run("--help")
    assert done.returncode == 0
    runnable = {name for name, command in cli.cli.commands.items() if not command.hidden} | set(entry.LEAN_COMMANDS)
    assert _listed_commands(done.stdout) == runnable
    assert {"hook", "cdi-hook"} <= _listed_commands(done.stdout)


def test_the_lean_commands_listed_by_click_still_take_the_lean_path():
    """`hook` and `cdi-hook` are dispatched before click: their --help is the hook's own, and click is never
    imported for them; the click entries run the same code if ever reached."""
    assert run("hook", "--help").stdout.startswith("usage: devinject hook")
    probe = ("import sys; from devinject.entry import main; main(['cdi-hook', 'update-ldcache', '--help']); "
             "print('click' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "False", done
    assert cli.run(["cdi-hook", "create-symlinks", "--bogus"]) == 1  # the click stub hands over: the hook's error


def _commands(group, path=()):
    for name, command in group.commands.items():
        if command.hidden:
            continue
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def test_every_command_and_option_has_help_text():
    missing = []
    for path, command in _commands(cli.cli):
        if not (command.help or command.short_help):
            missing.append(" ".join(path))
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip():
                missing.append(f"{' '.join(path)} {param.opts[0]}")
    for param in cli.cli.params:
        if isinstance(param, click.Option) and not (param.help or "").strip():
            missing.append(param.opts[0])
    assert missing == [], "no help text: " + ", ".join(missing)


def test_each_cdi_hook_subcommand_help_lists_every_flag_the_generated_specs_use():
    done = run("generate", "--root", str(HOSTS / "hgx-h100"), "--hook-path", "/usr/bin/devinject", "--output", "-",
               "--format", "json")
    assert done.returncode == 0, done.stderr
    used: dict[str, set[str]] = {}
    for spec in json.loads(done.stdout):
        for hook in spec.get("containerEdits", {}).get("hooks", []):
            args = hook["args"]
            if args[1:2] == ["cdi-hook"]:
                used.setdefault(args[2], set()).update(a for a in args[3:] if a.startswith("--"))
    assert used["links-and-ldcache"] == {"--link", "--folder", "--forward-compat"}, used  # the fixture uses all
    overview = run("cdi-hook", "--help")
    assert overview.returncode == 0
    for command, flags in used.items():
        assert command in overview.stdout
        helped = run("cdi-hook", command, "--help")
        assert helped.returncode == 0 and helped.stderr == "", helped.stderr
        assert helped.stdout.startswith(f"usage: devinject cdi-hook {command}")
        for flag in flags:
            assert flag in helped.stdout, (command, flag, helped.stdout)


def _config_commands():
    return [name for name, command in cli.cli.commands.items()
            if any(p.name == "config" for p in command.params)]


def test_the_commands_with_a_config_file_are_known():
    assert _config_commands() == ["device-plugin", "dra-driver"]  # and `hook --config` (JSON, below)


@pytest.mark.parametrize("command", _config_commands())
def test_a_malformed_config_file_is_one_line_naming_file_line_and_column(tmp_path, command):
    config = tmp_path / "config.yaml"
    config.write_text("interval: 7\nkind: [nvidia.com/gpu\nplugin-dir: /x\n")  # the flow sequence never closes
    done = run(command, "--config", str(config))
    assert done.returncode != 0
    assert done.stderr.splitlines() == [done.stderr.rstrip("\n")], done.stderr
    assert done.stderr.startswith(f"devinject: error: {config}:3:11: "), done.stderr
    config.write_text("plugin_dirr: /x\n")
    done = run(command, "--config", str(config))
    assert done.returncode == 2 and done.stderr == f"devinject: error: {config}: unknown option 'plugin_dirr'\n"
    config.write_text("- a\n- b\n")
    done = run(command, "--config", str(config))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and str(config) in done.stderr
    done = run(command, "--config", str(tmp_path / "absent.yaml"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "absent.yaml" in done.stderr
    config.write_text("kind: [nvidia.com/gpu]\ninterval: often\n")  # a value of the wrong type: the file's fault
    done = run(command, "--config", str(config))
    assert done.returncode == 2 and done.stderr == f"devinject: error: {config}: interval: 'often' is not a valid " \
                                                   "float.\n", done.stderr


def test_a_malformed_hook_config_file_is_one_line_naming_file_line_and_column(tmp_path):
    config = tmp_path / "hook.json"
    config.write_text('{"ledger": true,\n "log_file": }\n')
    done = run("hook", "--config", str(config), stdin="{}")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.rstrip("\n")], done.stderr
    assert done.stderr.startswith(f"devinject: error: {config}:2:14: "), done.stderr
