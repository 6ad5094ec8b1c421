"""The commands docs/deploy.md and the README's quick start mark ```sh test run as shown (each line's exit code
0, or the `# exit N` its comment says), with `/etc/` moved into a temporary directory; the containerd config
the guide configures and reverts is the same bytes afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDES = (REPO / "docs" / "deploy.md", REPO / "README.md")
ADMIN = '# the admin\'s\nversion = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause:3.9"\n'


def blocks() -> list[str]:
    return [block for guide in GUIDES for block in re.findall(r"^```sh test\n(.*?)^```", guide.read_text(),
                                                               re.S | re.M)]


def test_the_guides_mark_commands_for_this_test():
    assert len(blocks()) >= 4


@pytest.mark.parametrize("index", range(len(blocks())))
def test_the_guides_commands_run_as_shown(index: int, tmp_path: Path):
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(ADMIN)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    for line in blocks()[index].splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        expected = re.search(r"#\s*exit (\d+)\b", line)
        command = line.replace(" /etc/", f" {tmp_path}/etc/")
        done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == (int(expected.group(1)) if expected else 0), (line, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
    assert config.read_text() == ADMIN
