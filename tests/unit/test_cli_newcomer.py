"""The small things a newcomer meets: the hook's --help describes its flags, help reads as English with one
metavar style, `-o` for generate, validate names its dirs, list shows MIG instances and sorts as health does,
usage errors exit 2, a put-back typo lists candidates, install-hook refuses a hooks dir that is not there, a
kubeconfig that is not one is one line, a profile's YAML error is FILE:LINE:COL, events on a missing state dir
says so."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from devinject import cli
from tests.conftest import HOSTS

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DEVINJECT, *args], capture_output=True, text=True, timeout=60)


def invoke(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(cli.cli, list(args))
    return done.exit_code, done.output


def test_hook_help_describes_every_flag_of_its_usage():
    done = run("hook", "--help")
    assert done.returncode == 0
    usage, _, flags = done.stdout.partition("\n\n")
    for flag in set(re.findall(r"--[a-z-]+", usage)) - {"--help"}:
        assert re.search(rf"^\s+{flag}\b|; {flag} ", flags, re.M), flag


def _options() -> list[tuple[str, click.Option]]:
    found = []

    def walk(command: click.Command, path: str) -> None:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")
        for param in command.params:
            if isinstance(param, click.Option):
                found.append((path, param))

    walk(cli.cli, "devinject")
    return found


def test_one_metavar_style_no_click_default_names():
    """Options that take a value name it in capitals (FILE, DIRECTORY, PATH, KIND, ...), never click's own TEXT."""
    ctx = click.Context(cli.cli)
    wrong = [f"{path} {opt.opts[-1]}: {opt.make_metavar(ctx)}" for path, opt in _options()
             if not opt.is_flag and not opt.count and opt.make_metavar(ctx) in ("TEXT", "PATH") and opt.metavar is None
             and not isinstance(opt.type, click.Choice)]
    assert not wrong, wrong


def test_node_hook_help_is_a_sentence():
    help_text = cli.node_hook_option(lambda: None).__click_params__[0].help  # type: ignore[attr-defined]
    assert help_text.startswith("Run the specs' CDI hooks from the node hook bundle installed in DIRECTORY")


def test_generate_takes_o_and_validate_names_its_dirs():
    code, out = invoke("generate", "--root", str(HOSTS / "gaudi2"), "-o", "-", "--hook-path", "/usr/bin/devinject")
    assert code == 0 and out.startswith("---\ncdiVersion:")
    code, out = invoke("validate", "--help")
    assert "/etc/cdi" in out and "/var/run/cdi" in out


def test_list_shows_mig_instances_and_sorts_as_health_does():
    code, out = invoke("list", "--root", str(HOSTS / "dgx-a100-mig"), "--state-dir", "/nonexistent/state")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()[1:]]
    assert names[:3] == ["nvidia.com/gpu=0", "nvidia.com/gpu=0:0", "nvidia.com/gpu=0:1"]
    assert "MIG gi1-ci0" in out
    listed = [n for n in names if ":" not in n]
    code, out = invoke("health", "--root", str(HOSTS / "dgx-a100-mig"))
    assert [line.split()[0] for line in out.splitlines()] == listed
    code, out = invoke("list", "--root", str(HOSTS / "hgx-h100"), "--state-dir", "/nonexistent/state")
    first = [line.split()[0] for line in out.splitlines()[1:]]
    assert first[0] == "nvidia.com/gpu=0" and first[8] == "nvidia.com/rdma=0"  # by kind, then PCI address


def test_usage_errors_exit_2_and_failures_1(tmp_path: Path):
    assert run("list", "--root", str(tmp_path / "nowhere")).returncode == 2
    assert run("watch", "--root", str(HOSTS / "gaudi2"), "--interval", "100").returncode == 2
    assert run("generate", "--root", str(HOSTS / "hgx-h100"), "--output", str(tmp_path / "x.yaml"),
               "--hook-path", "/usr/bin/devinject").returncode == 2  # two kinds for one file
    assert run("generate", "--root", str(HOSTS / "gaudi2"), "--kind", "nvidia.com/gpu", "-o", "-").returncode == 1


def test_put_back_typo_lists_candidates(tmp_path: Path):
    done = run("put-back", "nvidia.com/gpu=9", "--root", str(HOSTS / "hgx-h100"), "--state-dir", str(tmp_path))
    assert done.returncode == 1 and "did you mean nvidia.com/gpu=" in done.stderr
    done = run("put-back", "zzz", "--root", str(HOSTS / "gaudi2"), "--state-dir", str(tmp_path))
    assert "; devices: habana.ai/gaudi=0" in done.stderr and len(done.stderr.splitlines()) == 1


def test_install_hook_refuses_a_hooks_dir_that_is_not_there(tmp_path: Path):
    done = run("install-hook", "--hooks-dir", str(tmp_path / "nonexistent/dir"), "--executable", DEVINJECT)
    assert done.returncode == 2 and f"no such directory as {tmp_path / 'nonexistent'}" in done.stderr
    assert not (tmp_path / "nonexistent").exists()


def test_dra_driver_kubeconfig_that_is_not_one_is_one_line(tmp_path: Path):
    for text in ("just a string\n", "[1, 2]\n", "clusters: {a: 1}\n", "key: [unclosed\n"):
        bad = tmp_path / "kubeconfig"
        bad.write_text(text)
        done = run("dra-driver", "--node-name", "n", "--kubeconfig", str(bad), "--root", str(HOSTS / "gaudi2"),
                   "--state-dir", str(tmp_path / "state"))
        assert done.returncode == 2, (text, done.stderr)
        assert done.stderr.startswith(f"devinject: error: --kubeconfig {bad}") and len(done.stderr.splitlines()) == 1
        assert "Traceback" not in done.stderr


def test_a_profile_yaml_error_is_file_line_col(tmp_path: Path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "bad.yaml").write_text("name: x\nkind: [unclosed\n")
    done = run("list", "--root", str(HOSTS / "gaudi2"), "--profile-dir", str(profiles))
    assert done.returncode != 0
    assert re.match(rf"devinject: error: {re.escape(str(profiles / 'bad.yaml'))}:\d+:\d+: ", done.stderr), done.stderr


def test_events_on_a_missing_state_dir_says_so(tmp_path: Path):
    done = run("events", "--state-dir", str(tmp_path / "nowhere"))
    assert done.returncode == 0 and "does not exist" in done.stderr


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_watch_says_why_it_stopped(tmp_path, signum, status):
    """Was: Ctrl-C on `watch` exited 0 without a word."""
    agent = subprocess.Popen([DEVINJECT, "watch", "--root", str(HOSTS / "gaudi2"), "--no-uevents", "--output-dir",
                              str(tmp_path / "out"), "--state-dir", str(tmp_path / "state"),
                              "--hook-path", "/usr/bin/devinject"],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out").is_dir() or not any((tmp_path / "out").iterdir()):
            assert agent.poll() is None and time.monotonic() < deadline, "watch never wrote its specs"
            time.sleep(0.1)
        agent.send_signal(signum)
        _, err = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode == status
    assert f"devinject: INFO: {signal.Signals(signum).name}: stopping" in err
