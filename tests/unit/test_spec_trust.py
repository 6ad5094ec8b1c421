"""Spec files are code that runs as root: the hook and `validate` refuse files (and directories) that someone
other than root could change, never open anything but regular files, and refuse YAML alias bombs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devinject.core.errors import ResolveError
from devinject.hook.registry import Registry
from devinject.specs.validate import validate_paths
from tests.e2e.conftest import require

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def spec(kind: str = "vendor.com/gpu", name: str = "0") -> str:
    return (f"cdiVersion: 0.5.0\nkind: {kind}\ndevices:\n- name: '{name}'\n  containerEdits:\n"
            f"    deviceNodes: [{{path: /dev/x{name}, type: c, major: 1, minor: 3}}]\n")


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "cdi"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    (directory / "good.yaml").write_text(spec("good.com/dev"))
    return directory


def as_root() -> None:
    require(os.geteuid() == 0, "needs root (chown to another user)")


@pytest.mark.parametrize(("change", "reason"), [
    (lambda p: os.chown(p, 1000, 1000), "owned by uid 1000, not root"),
    (lambda p: os.chmod(p, 0o664), "writable by group or others"),
    (lambda p: os.chmod(p, 0o646), "writable by group or others"),
])
def test_hook_refuses_a_spec_file_others_could_change(spec_dir: Path, change, reason: str) -> None:
    as_root()
    bad = spec_dir / "bad.yaml"
    bad.write_text(spec())
    change(bad)
    registry = Registry((str(spec_dir),))
    assert registry.resolve(("good.com/dev=0",)).names == ("good.com/dev=0",)  # other kinds are unaffected
    with pytest.raises(ResolveError) as caught:
        registry.resolve(("vendor.com/gpu=0",))
    assert f"{bad}: spec file {reason}; refused" in caught.value.message


def test_a_spec_dir_others_could_change_is_refused_and_a_sticky_one_is_not(spec_dir: Path) -> None:
    as_root()
    os.chmod(spec_dir, 0o777)
    registry = Registry((str(spec_dir),))
    with pytest.raises(ResolveError, match="spec directory writable by group or others"):
        registry.resolve(("good.com/dev=0",))
    os.chmod(spec_dir, 0o1777)  # like /tmp: others may add files (refused by owner) but not replace ours
    assert Registry((str(spec_dir),)).resolve(("good.com/dev=0",)).names == ("good.com/dev=0",)
    os.chown(spec_dir, 1000, 1000)
    os.chmod(spec_dir, 0o755)
    with pytest.raises(ResolveError, match="spec directory owned by uid 1000"):
        Registry((str(spec_dir),)).resolve(("good.com/dev=0",))


def test_a_refused_file_is_refused_even_when_its_parse_is_cached(spec_dir: Path, tmp_path: Path) -> None:
    as_root()
    cache = str(tmp_path / "state" / "spec-cache.json")
    assert Registry((str(spec_dir),), cache_file=cache).resolve(("good.com/dev=0",))
    os.chmod(spec_dir / "good.yaml", 0o666)  # same size, mtime and inode: the cache key still matches
    with pytest.raises(ResolveError, match="writable by group or others"):
        Registry((str(spec_dir),), cache_file=cache).resolve(("good.com/dev=0",))


def test_fifos_and_sockets_in_a_spec_dir_are_skipped_never_opened(spec_dir: Path) -> None:
    os.mkfifo(spec_dir / "pipe.yaml")  # opening it for reading would block forever
    import socket

    server = socket.socket(socket.AF_UNIX)
    server.bind(str(spec_dir / "sock.json"))
    try:
        code = ("from devinject.hook.registry import Registry\n"
                f"print(Registry(({str(spec_dir)!r},)).resolve(('good.com/dev=0',)).names)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
        assert done.returncode == 0, done.stderr
        assert "good.com/dev=0" in done.stdout
        files, problems = validate_paths([str(spec_dir)])
        assert [f.name for f in files] == ["good.yaml"] and problems == []
    finally:
        server.close()


def test_a_fifo_swapped_in_for_a_named_file_does_not_hang_validate(tmp_path: Path) -> None:
    fifo = tmp_path / "named.yaml"
    os.mkfifo(fifo)
    done = subprocess.run([DEVINJECT, "validate", str(fifo)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 1
    assert f"{fifo}: not a regular file; refused" in done.stderr


ALIAS_BOMB = """cdiVersion: 0.5.0
kind: vendor.com/gpu
a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
devices: [{name: '0', containerEdits: {deviceNodes: [{path: /dev/x, type: c, major: 1, minor: 3}]}}]
"""


def test_yaml_alias_bombs_are_refused_quickly(spec_dir: Path) -> None:
    bomb = spec_dir / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    started = time.monotonic()
    files, problems = validate_paths([str(bomb)])
    assert problems == [f"{bomb}: expands to more than 1000000 nodes (YAML aliases); refused"]
    with pytest.raises(ResolveError, match="expands to more than 1000000 nodes"):
        Registry((str(spec_dir),)).resolve(("vendor.com/gpu=0",))
    assert time.monotonic() - started < 20  # 10^9 nodes if expanded: this only guards against a hang


def test_a_little_aliasing_is_fine(spec_dir: Path) -> None:
    text = ("cdiVersion: 0.5.0\nkind: vendor.com/gpu\ndevices:\n"
            "- name: '0'\n  containerEdits: &edits {deviceNodes: [{path: /dev/x, type: c, major: 1, minor: 3}]}\n"
            "- name: '1'\n  containerEdits: *edits\n")
    (spec_dir / "aliases.yaml").write_text(text)
    assert validate_paths([str(spec_dir / "aliases.yaml")])[1] == []
    assert Registry((str(spec_dir),)).resolve(("vendor.com/gpu=1",)).names == ("vendor.com/gpu=1",)


def test_validate_names_the_untrusted_file_and_exits_non_zero(spec_dir: Path) -> None:
    as_root()
    bad = spec_dir / "bad.yaml"
    bad.write_text(spec())
    os.chown(bad, 1000, 1000)
    done = subprocess.run([DEVINJECT, "validate", str(spec_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"{bad}: spec file owned by uid 1000, not root; refused "
                                                "(specs run as root)"]
    assert f"ok: {spec_dir / 'good.yaml'}" in done.stdout
