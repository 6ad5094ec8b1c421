"""`NamedTuple` class syntax without importing `typing` (or running `exec`) at run time.

The hook's in-process start (and every `cdi-hook`, which always runs in-process) pays for each import:
`typing` costs ~2 ms, and `collections.namedtuple`, which compiles a `__new__` per class, ~1 ms more for the
hook's records (bench/bench_hook_imports.py measures both). Type checkers see `typing.NamedTuple` (modules
import this one only in the `else` branch of `if TYPE_CHECKING`); at run time this builds an equivalent tuple
subclass, with the language's public parts only: fields from the annotations, defaults from the class
body, each field a property over a two-line function of this module (not `operator.itemgetter`: `operator`
is ~0.4 ms of imports on every in-process start, for accessors a hook calls a few hundred times; nor CPython's
private C accessor), methods and properties kept.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

_NOT_COPIED = {"__annotations__", "__annotate__", "__annotate_func__", "__annotations_cache__", "__dict__",
               "__weakref__", "__orig_bases__"}


def _make_new(name: str, fields: tuple[str, ...], defaults: dict[str, object]) -> Callable[..., tuple[object, ...]]:
    count = len(fields)

    def __new__(cls: type[tuple[object, ...]], *args: object, **kwargs: object) -> tuple[object, ...]:
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


def _fields(record: tuple[object, ...]) -> tuple[str, ...]:
    fields: tuple[str, ...] = getattr(type(record), "_fields")  # noqa: B009  # the class's, set below
    return fields


def _repr(self: tuple[object, ...]) -> str:
    pairs = zip(_fields(self), self, strict=True)
    return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in pairs)})"


def _replace(self: tuple[object, ...], **changes: object) -> tuple[object, ...]:
    values = [changes.pop(f, v) for f, v in zip(_fields(self), self, strict=True)]
    record: Callable[..., tuple[object, ...]] = type(self)  # the record's own __new__: a left-over change is an error
    return record(*values, **changes)


def _asdict(self: tuple[object, ...]) -> dict[str, object]:
    return dict(zip(_fields(self), self, strict=True))


def _field_names(name: str, namespace: dict[str, object]) -> tuple[str, ...]:
    """The annotated names of a class body, whatever the module's annotations mode: a dict in
    `__annotations__` (`from __future__ import annotations`, or eager annotations before Python 3.14), or, from
    3.14 on (PEP 649/749), an annotate function, asked for names only (FORWARDREF: nothing is evaluated)."""
    annotations = namespace.get("__annotations__")
    if annotations is None:
        from importlib import import_module

        try:  # Python 3.14+; imported only for a module with lazy annotations
            annotationlib = import_module("annotationlib")
        except ImportError:
            pass
        else:
            annotate = annotationlib.get_annotate_from_class_namespace(namespace)
            if annotate is not None:
                annotations = annotationlib.call_annotate_function(annotate, annotationlib.Format.FORWARDREF)
    if not isinstance(annotations, dict) or not annotations:
        # A record without fields is always a mistake (a body of methods only, or annotations this cannot
        # read): refused here rather than built as an empty tuple that fails far from its definition.
        raise TypeError(f"{name}: a record needs annotated fields (`name: type`), found none")
    return tuple(annotations)


def _getnewargs(self: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(self)


def _field(index: int, name: str) -> property:
    def get(self: tuple[object, ...]) -> object:
        return self[index]

    get.__name__ = name
    return property(get, doc=f"field {index}: {name}")


class _Meta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, object]) -> type:
        if not bases:  # the `NamedTuple` marker class itself
            return super().__new__(mcls, name, bases, namespace)
        fields = _field_names(name, namespace)
        defaults = {f: namespace[f] for f in fields if f in namespace}
        seen_default = False
        for field in fields:
            if field in defaults:
                seen_default = True
            elif seen_default:
                raise TypeError(f"{name}: field {field!r} without a default follows one with a default")
        body = {k: v for k, v in namespace.items() if k not in _NOT_COPIED and k not in fields}
        body.update({f: _field(i, f) for i, f in enumerate(fields)})
        body.update(__new__=_make_new(name, fields, defaults), __slots__=(), _fields=fields,
                    _field_defaults=defaults, __match_args__=fields, _replace=_replace, _asdict=_asdict,
                    __getnewargs__=_getnewargs)
        body.setdefault("__repr__", _repr)
        return type(name, (tuple,), body)


class NamedTuple(metaclass=_Meta):
    pass
