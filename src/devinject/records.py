"""`NamedTuple` class syntax without importing `typing` at run time.

`typing` costs the OCI hook ~2 ms on every container start. Type checkers see `typing.NamedTuple`
(modules import this one only in the `else` branch of `if TYPE_CHECKING`); at run time this builds the
same thing from `collections.namedtuple`: fields from the annotations, defaults from the class body,
methods and properties kept.
"""

import collections

_NOT_COPIED = {"__annotations__", "__module__", "__qualname__", "__dict__", "__weakref__", "__orig_bases__"}


class _Meta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, object]) -> type:
        if not bases:  # the `NamedTuple` marker class itself
            return super().__new__(mcls, name, bases, namespace)
        fields = list(namespace.get("__annotations__", {}))  # type: ignore[call-overload]
        defaults = [namespace[f] for f in fields if f in namespace]
        base = collections.namedtuple(name, fields, defaults=defaults or None,  # type: ignore[misc]
                                      module=str(namespace.get("__module__")))
        body = {k: v for k, v in namespace.items() if k not in _NOT_COPIED and k not in fields}
        body["__slots__"] = ()
        body["__module__"] = namespace.get("__module__")
        body["__qualname__"] = namespace.get("__qualname__", name)
        return type(name, (base,), body)


class NamedTuple(metaclass=_Meta):
    pass
