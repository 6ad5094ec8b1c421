"""Path strings as `posixpath` computes them, without importing it: `posixpath` imports `os` (and with it
`_collections_abc`, `stat` and `genericpath`), ~0.9 ms of every in-process container start, and the
cdi-hook's modules import neither (tests/e2e/test_hook_edges.py). Strings only, nothing asked of the file
system; tests/unit/test_purepath.py holds each equal to posixpath's."""

try:  # CPython's own normpath in C, which posixpath.normpath calls since 3.11; private, so kept in hook/
    from posix import _path_normpath  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - not CPython
    from posixpath import normpath as _path_normpath


def normpath(path: str) -> str:
    """`a//b/./c/../d` -> `a/b/d`, as posixpath.normpath (`..` taken lexically, links not looked at)."""
    normal: str = _path_normpath(path)
    return normal or "."


def join(head: str, tail: str) -> str:
    """posixpath.join of two: `tail` when it is absolute, else the two with one `/` between."""
    if tail.startswith("/"):
        return tail
    if not head or head.endswith("/"):
        return head + tail
    return f"{head}/{tail}"


def dirname(path: str) -> str:
    """posixpath.dirname: what comes before the last `/`, its trailing slashes dropped (the root's kept)."""
    head = path[:path.rfind("/") + 1]
    return head.rstrip("/") or head
