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
    """No private C accessor (`_collections._tuplegetter`): a field is a property over operator.itemgetter."""
    accessor = Point.__dict__["x"]
    assert isinstance(accessor, property) and accessor.__doc__ == "field 0: x"
    assert type(accessor.fget).__module__ == "operator"
