"""hook/purepath.py computes path strings as posixpath does (the hook imports no `os`, which posixpath imports):
every path of up to four parts drawn from the shapes that matter (empty, `.`, `..`, names, runs of slashes)."""

import itertools
import posixpath

from devinject.hook import purepath

PARTS = ("", "/", "//", "///", ".", "..", "a", "b.so.1", "...", " ")
PATHS = sorted({"".join(parts) for size in range(5) for parts in itertools.product(PARTS, repeat=size)})


def test_normpath_is_posixpath_s() -> None:
    assert len(PATHS) > 4000
    assert [purepath.normpath(p) for p in PATHS] == [posixpath.normpath(p) for p in PATHS]


def test_dirname_is_posixpath_s() -> None:
    assert [purepath.dirname(p) for p in PATHS] == [posixpath.dirname(p) for p in PATHS]


def test_join_is_posixpath_s() -> None:
    heads = PATHS[::7]
    assert [purepath.join(h, t) for h in heads for t in PATHS[::11]] == \
        [posixpath.join(h, t) for h in heads for t in PATHS[::11]]
