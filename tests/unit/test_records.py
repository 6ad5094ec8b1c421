"""The run-time NamedTuple behaves like typing.NamedTuple for everything devinject relies on."""

import pickle

import pytest

from devinject.core.records import NamedTuple


class Point(NamedTuple):
    x: int
    y: int = 0
    label: str | None = None

    @property
    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)

    def moved(self, dx: int) -> "Point":
        return Point(self.x + dx, self.y, self.label)


def test_construction_defaults_and_access():
    p = Point(1, 2, "a")
    assert (p.x, p.y, p.label) == (1, 2, "a") and p == (1, 2, "a")
    assert Point(3) == Point(x=3) == Point(3, label=None) == (3, 0, None)
    assert Point(1, y=5).y == 5 and Point(1, 2).norm1 == 3 and Point(1).moved(2).x == 3


def test_equality_hash_repr_replace_asdict_pickle():
    p = Point(1, 2)
    assert hash(p) == hash((1, 2, None)) and {p: 1}[Point(1, 2)] == 1
    assert repr(p) == "Point(x=1, y=2, label=None)"
    assert p._replace(y=9) == Point(1, 9) and p._asdict() == {"x": 1, "y": 2, "label": None}
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(AttributeError):
        p.x = 5  # immutable


def test_bad_arguments():
    with pytest.raises(TypeError, match="missing argument 'x'"):
        Point()
    with pytest.raises(TypeError, match="unexpected argument 'z'"):
        Point(1, z=2)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        Point(1, 2, 3, 4)


def test_default_order_is_enforced():
    with pytest.raises(TypeError, match="without a default"):
        class Bad(NamedTuple):
            a: int = 1
            b: int


def test_replace_refuses_a_field_the_record_has_not():
    with pytest.raises(TypeError, match="unexpected argument 'z'"):
        Point(1)._replace(z=2)


def test_it_is_built_from_public_parts_only():
    """No private C accessor (`_collections._tuplegetter`), and no `operator` (an import on every hook start): a
    field is a property over a plain function of records.py."""
    accessor = Point.__dict__["x"]
    assert isinstance(accessor, property) and accessor.__doc__ == "field 0: x"
    assert accessor.fget.__module__ == "devinject.core.records" and accessor.fget.__name__ == "x"
    assert (Point(1, 2).x, Point(1, 2).y) == (1, 2)


RECORD_MODULE = '''
from devinject.core.records import NamedTuple


class Slot(NamedTuple):
    index: int
    name: "str" = "x"
    tags: tuple[str, ...] = ()
'''


@pytest.mark.parametrize("future", [True, False], ids=["string-annotations", "module-default-annotations"])
def test_fields_whatever_the_module_annotations_mode(tmp_path, monkeypatch, future):
    """A module without `from __future__ import annotations` gets the same record as one with it."""
    import importlib

    name = f"record_mode_{'future' if future else 'default'}"
    (tmp_path / f"{name}.py").write_text(("from __future__ import annotations\n" if future else "") + RECORD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    slot = importlib.import_module(name).Slot
    assert slot._fields == ("index", "name", "tags") and slot._field_defaults == {"name": "x", "tags": ()}
    assert slot(3) == (3, "x", ()) and slot(3, tags=("a",)).tags == ("a",)


def test_a_record_without_fields_is_refused_loudly():
    with pytest.raises(TypeError, match="Nothing: a record needs annotated fields"):
        class Nothing(NamedTuple):
            def method(self) -> int:
                return 1


def test_lazy_annotations_are_read_through_annotationlib(monkeypatch):
    """Python 3.14 (PEP 649/749) puts an annotate function in the class namespace, no `__annotations__`: the
    names come from annotationlib, asked for forward references (nothing is evaluated). annotationlib stands
    in here with the calls 3.14 has, so the path runs on every interpreter the project supports."""
    import sys
    import types
    from enum import IntEnum

    class Format(IntEnum):
        VALUE = 1
        FORWARDREF = 3

    asked: list[int] = []

    def annotate(fmt: int) -> dict[str, object]:
        asked.append(fmt)
        return {"index": "Undefined", "name": "str"}  # `Undefined` would fail to evaluate

    fake = types.ModuleType("annotationlib")
    fake.Format = Format  # type: ignore[attr-defined]
    fake.get_annotate_from_class_namespace = lambda ns: ns.get("__annotate_func__")  # type: ignore[attr-defined]
    fake.call_annotate_function = lambda fn, fmt: fn(fmt)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "annotationlib", fake)
    lazy = type(NamedTuple)("Lazy", (NamedTuple,), {"__annotate_func__": annotate, "name": "n"})
    assert lazy._fields == ("index", "name") and lazy(1) == (1, "n") and asked == [Format.FORWARDREF]
    assert "__annotate_func__" not in vars(lazy)


@pytest.mark.skipif(not __import__("shutil").which("python3.14"), reason="no python3.14 on this machine")
def test_on_python_3_14_both_modes(tmp_path):
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    for header in ("from __future__ import annotations\n", ""):
        script = header + RECORD_MODULE + "print(Slot._fields)\n"
        done = subprocess.run(["python3.14", "-c", script], capture_output=True, text=True, timeout=60,
                              env={"PYTHONPATH": str(src)})
        assert done.stdout.strip() == "('index', 'name', 'tags')", done.stderr
