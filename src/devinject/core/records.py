"""`NamedTuple` class syntax without importing `typing` (or running `exec`) at run time.

The hook pays for every import on every container start: `typing` costs ~2 ms and
`collections.namedtuple`, which compiles a `__new__` per class, ~1 ms more for the hook's records.
Type checkers see `typing.NamedTuple` (modules import this one only in the `else` branch of
`if TYPE_CHECKING`); at run time this builds an equivalent tuple subclass: fields from the annotations,
defaults from the class body, C field accessors, methods and properties kept.
"""

from _collections import _tuplegetter  # type: ignore[import-not-found]  # C field accessor, as namedtuple's

_NOT_COPIED = {"__annotations__", "__dict__", "__weakref__", "__orig_bases__"}


def _make_new(name: str, fields: tuple[str, ...], defaults: dict[str, object]):  # type: ignore[no-untyped-def]
    count = len(fields)

    def __new__(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        if len(args) > count:
            raise TypeError(f"{name}() takes {count} arguments, {len(args)} given")
        if not kwargs and len(args) == count:
            return tuple.__new__(cls, args)
        values = list(args)
        for field in fields[len(args):]:
            if field in kwargs:
                values.append(kwargs.pop(field))
            elif field in defaults:
                values.append(defaults[field])
            else:
                raise TypeError(f"{name}() missing argument {field!r}")
        if kwargs:
            raise TypeError(f"{name}() got an unexpected argument {next(iter(kwargs))!r}")
        return tuple.__new__(cls, values)

    return __new__


def _repr(self: tuple) -> str:  # type: ignore[type-arg]
    fields = type(self)._fields  # type: ignore[attr-defined]
    return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in zip(fields, self, strict=True))})"


def _replace(self: tuple, **changes: object) -> tuple:  # type: ignore[type-arg]
    fields = type(self)._fields  # type: ignore[attr-defined]
    values: list[object] = [changes.pop(f, v) for f, v in zip(fields, self, strict=True)]
    return type(self)(*values, **changes)  # type: ignore[arg-type]


def _asdict(self: tuple) -> dict[str, object]:  # type: ignore[type-arg]
    return dict(zip(type(self)._fields, self, strict=True))  # type: ignore[attr-defined]


class _Meta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, object]) -> type:
        if not bases:  # the `NamedTuple` marker class itself
            return super().__new__(mcls, name, bases, namespace)
        annotations = namespace.get("__annotations__", {})
        fields: tuple[str, ...] = tuple(annotations) if isinstance(annotations, dict) else ()
        defaults = {f: namespace[f] for f in fields if f in namespace}
        seen_default = False
        for field in fields:
            if field in defaults:
                seen_default = True
            elif seen_default:
                raise TypeError(f"{name}: field {field!r} without a default follows one with a default")
        body = {k: v for k, v in namespace.items() if k not in _NOT_COPIED and k not in fields}
        body.update({f: _tuplegetter(i, f"field {i}: {f}") for i, f in enumerate(fields)})
        body.update(__new__=_make_new(name, fields, defaults), __slots__=(), _fields=fields,
                    _field_defaults=defaults, __match_args__=fields, _replace=_replace, _asdict=_asdict)
        body.setdefault("__repr__", _repr)
        body["__getnewargs__"] = lambda self: tuple(self)
        return type(name, (tuple,), body)


class NamedTuple(metaclass=_Meta):
    pass
