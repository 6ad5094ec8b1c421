"""One spelling per meaning (docs/lifecycle.md, "Option names"): the directory options of every command are
named from one list, and the spellings they replaced still work, out of --help."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from devinject.agent.nfd import FEATURE_FILE
from devinject.cli import cli
from tests.conftest import HOSTS

# (command, its name now, the spelling it replaced, the parameter both fill)
RENAMED = [("dra-driver", "--output-dir", "--cdi-dir", "cdi_dir"),
           ("install-node-hook", "--output-dir", "--dir", "directory"),
           ("labels", "--nfd-features-dir", "--write", "directory")]
# every directory an option names, by meaning: where a command makes its product, then the directories other
# programs read, named as they name them, then devinject's own state and profiles and the roots
DIRECTORY_OPTIONS = {"--output-dir", "--spec-dir", "--hooks-dir", "--unit-dir", "--plugin-dir", "--registry-dir",
                     "--nfd-features-dir", "--config-dir", "--state-dir", "--profile-dir", "--host-root",
                     "--target-root", "--driver-root", "--node-hook"}


def _commands(group: click.Group = cli, prefix: str = "") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(_commands(command, f"{prefix}{name} "))
        else:
            found[prefix + name] = command
    return found


def _shown(command: click.Command, ctx: click.Context) -> list[str]:
    """The option names --help shows."""
    return [name for p in command.params if (record := p.get_help_record(ctx))
            for name in record[0].split(" ")[0].replace("/", ",").split(",") if name.startswith("--")]


@pytest.mark.parametrize(("command", "new", "old", "param"), RENAMED)
def test_the_new_spelling_and_the_old_one_set_the_same_option(command: str, new: str, old: str, param: str,
                                                              tmp_path: Path) -> None:
    parse = cli.commands[command]
    for spelling in (new, old):
        params = parse.make_context(command, [spelling, str(tmp_path)], default_map={"node_name": "n"}).params
        assert params[param] == str(tmp_path), spelling
    shown = CliRunner().invoke(cli, [command, "--help"]).output
    assert f"{new} DIRECTORY" in shown and f"{old} " not in shown and f"{old}," not in shown


def test_labels_writes_its_file_under_either_spelling(tmp_path: Path) -> None:
    for spelling in ("--nfd-features-dir", "--write"):
        target = tmp_path / spelling.strip("-")
        target.mkdir()
        done = CliRunner().invoke(cli, ["labels", "--root", str(HOSTS / "gaudi2"), spelling, str(target)])
        assert done.exit_code == 0 and (target / FEATURE_FILE).is_file(), done.output
    done = CliRunner().invoke(cli, ["labels", "--root", str(HOSTS / "gaudi2"), "--write", str(tmp_path / "no")])
    assert done.exit_code == 2 and "--nfd-features-dir" in done.output and "no such directory" in done.output


def test_every_directory_option_has_its_meanings_one_name() -> None:
    """A DIRECTORY option of any command is spelled from DIRECTORY_OPTIONS (a new meaning: add its name here and
    to docs/lifecycle.md); --output-dir, --dir and --cdi-dir were three spellings of where a command writes."""
    odd = {}
    for name, command in _commands().items():
        ctx = click.Context(command, info_name=name)
        directories = [p for p in command.params if isinstance(p, click.Option) and p.metavar == "DIRECTORY"]
        shown = set(_shown(command, ctx))
        for option in directories:
            names = [n for n in option.opts if n.startswith("--") and n in shown]
            if not set(names) <= DIRECTORY_OPTIONS or not names:
                odd[f"{name} {option.name}"] = names
    assert not odd, odd
    shown_anywhere = {n for name, c in _commands().items() for n in _shown(c, click.Context(c, info_name=name))}
    assert {"--output-dir", "--spec-dir", "--nfd-features-dir"} <= shown_anywhere
    assert not {"--dir", "--cdi-dir", "--write"} & shown_anywhere


def test_a_config_file_giving_one_option_under_both_spellings_is_refused(tmp_path: Path) -> None:
    """dra-driver's --config with `cdi-dir:` and `output-dir:` names one option twice: one of the two values
    would be dropped unseen, so the file is refused naming both keys (either alone is read)."""
    config = tmp_path / "dra.yaml"
    parse = cli.commands["dra-driver"]
    for key in ("cdi-dir", "output-dir"):
        config.write_text(f"node-name: n\n{key}: {tmp_path}\n")
        assert parse.make_context("dra-driver", ["--config", str(config)]).params["cdi_dir"] == str(tmp_path)
    config.write_text(f"node-name: n\ncdi-dir: {tmp_path}/a\noutput-dir: {tmp_path}/b\n")
    done = CliRunner().invoke(cli, ["dra-driver", "--config", str(config)])
    assert done.exit_code == 2, done.output
    assert done.output.strip().splitlines()[-1] == (
        f"devinject: error: {config}: output-dir: the same option as cdi-dir, given twice")


def _devinject_args(path: Path) -> list[list[str]]:
    """The argument lists of the manifest's containers that run devinject."""
    import yaml

    found = []
    for doc in yaml.safe_load_all(path.read_text()):
        pod = ((doc or {}).get("spec", {}).get("template", {}) or {}).get("spec", {}) if isinstance(doc, dict) else {}
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            if container.get("command") == ["devinject"]:
                found.append([str(a) for a in container.get("args", [])])
    return found


def test_the_shipped_manifests_spell_every_option_as_help_does() -> None:
    """deploy/kubernetes runs what the docs teach: an old spelling parses, but one copied from a manifest into a
    new one would carry a deprecated name on (install-node-hook --dir, dra-driver --cdi-dir were shipped so)."""
    manifests = sorted((Path(__file__).parents[2] / "deploy" / "kubernetes").rglob("*.yaml"))
    old = {(command, spelling) for command, _, spelling, _ in RENAMED}
    used = [(path.name, args[0], a.partition("=")[0]) for path in manifests for args in _devinject_args(path)
            for a in args[1:] if (args[0], a.partition("=")[0]) in old]
    assert used == []
    assert sum(len(_devinject_args(path)) for path in manifests) >= 4  # both agents and their installers
