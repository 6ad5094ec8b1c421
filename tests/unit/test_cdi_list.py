"""`devinject cdi list`: the names a runtime on this node resolves, from the hook's own registry (the spec dirs
read once, by one reader: priorities, trust, conflicts), with the file each comes from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import HOSTS
from tests.unit.test_cli import run

GAUDI = str(HOSTS / "gaudi2")


def _generate(out: Path) -> None:
    done = run("generate", "--root", GAUDI, "--hook-path", "/bin/true", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr


def test_every_name_with_its_file_and_the_later_dir_wins(tmp_path: Path) -> None:
    static, dynamic = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    _generate(static)
    _generate(dynamic)
    done = run("cdi", "list", "--spec-dir", str(static), "--spec-dir", str(dynamic), "--json")
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    assert listing["conflicts"] == {} and listing["problems"] == []
    assert "habana.ai/gaudi=0" in listing["names"]
    assert set(listing["names"].values()) == {str(dynamic / "habana.ai-gaudi.yaml")}
    text = run("cdi", "list", "--spec-dir", str(static)).stdout.splitlines()
    assert any(line.split() == ["habana.ai/gaudi=0", str(static / "habana.ai-gaudi.yaml")] for line in text)


def test_a_name_defined_twice_in_one_dir_is_listed_as_unresolvable_and_exit_1(tmp_path: Path) -> None:
    """Two identical spec files in one dir: validate flagged it and the hook refused it; now `cdi list` (and
    doctor's spec link) say so too."""
    out = tmp_path / "cdi"
    _generate(out)
    shutil.copy(out / "habana.ai-gaudi.yaml", out / "habana.ai-gaudi-copy.yaml")
    done = run("cdi", "list", "--spec-dir", str(out))
    assert done.returncode == 1 and done.stdout == ""
    assert (f"habana.ai/gaudi=0: unresolvable: defined in both {out / 'habana.ai-gaudi-copy.yaml'} "
            f"and {out / 'habana.ai-gaudi.yaml'} (same priority)") in done.stderr.splitlines()


def test_a_dir_others_may_write_is_refused_as_the_hook_refuses_it(tmp_path: Path) -> None:
    out = tmp_path / "cdi"
    _generate(out)
    out.chmod(0o777)
    done = run("cdi", "list", "--spec-dir", str(out))
    assert done.returncode == 1 and "writable by group or others" in done.stderr and done.stdout == ""
