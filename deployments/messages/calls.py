"""Typed calls: one frozen dataclass per call, its arguments as fields, its reply type as the parameter of
`Call[Reply]` (docs/engine.md, Calls between steps).

A call checks its fields against their annotations when it is made (a wrong argument is a `TypeError`
naming the call and the field, before anything is sent); the side that answers dispatches with `match` on
the call's class and checks its value with `reply`, which hands the caller the reply's own type. Containers
are checked element by element; numpy arrays and other classes by `isinstance`.
"""

import re
import types
import typing
from typing import Any, ClassVar, Generic, TypeVar

Reply = TypeVar("Reply")


class Call(Generic[Reply]):
    """A call whose answer is a `Reply` (subclasses are frozen dataclasses naming their reply type)."""

    reply_type: ClassVar[object] = None  # the Reply of the concrete call class (None on the generic bases)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            origin, arguments = typing.get_origin(base), typing.get_args(base)
            if isinstance(origin, type) and issubclass(origin, Call) and not isinstance(arguments[0], TypeVar):
                cls.reply_type = arguments[0]

    def __post_init__(self) -> None:
        for name, hint in _field_hints(type(self)).items():
            value = getattr(self, name)
            if not conforms(value, hint):
                raise TypeError(
                    f"{type(self).__name__}.{name} must be {_spell(hint)}, not {type(value).__name__}: {value!r:.80}"
                )

    def reply(self, value: object) -> Reply:
        """`value` as this call's reply; a TypeError when it is not one (a fault of the side that answered)."""
        if not conforms(value, self.reply_type):
            raise TypeError(
                f"the answer to {type(self).__name__} must be {_spell(self.reply_type)}, not {type(value).__name__}"
            )
        return typing.cast(Reply, value)


_HINTS: dict[type, dict[str, object]] = {}  # each call class's field annotations, resolved on its first call


def _field_hints(cls: type) -> dict[str, object]:
    """The annotated fields of a call class."""
    hints = _HINTS.get(cls)
    if hints is None:
        fields = getattr(cls, "__dataclass_fields__", {})
        hints = _HINTS[cls] = {name: hint for name, hint in typing.get_type_hints(cls).items() if name in fields}
    return hints


def conforms(value: object, hint: object) -> bool:
    """Whether `value` is of the annotated type `hint` (None, unions, classes, and list, tuple, set and dict
    with their element types; `Any` takes anything; a bool is not an int, an int is a float)."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(conforms(value, argument) for argument in arguments)
    if origin is None:
        assert isinstance(hint, type), f"cannot check against {hint!r}"
        if hint is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, hint) and not (isinstance(value, bool) and hint is int)
    if not isinstance(value, origin):
        return False
    return _elements_conform(value, origin, arguments)


def _elements_conform(value: Any, origin: type, arguments: tuple) -> bool:
    if not arguments:
        return True
    if origin is dict:
        key, item = arguments
        return all(conforms(k, key) and conforms(v, item) for k, v in value.items())
    if origin is tuple and not (len(arguments) == 2 and arguments[1] is Ellipsis):
        return len(value) == len(arguments) and all(conforms(v, a) for v, a in zip(value, arguments))
    return all(conforms(v, arguments[0]) for v in value)


def _spell(hint: object) -> str:
    """A type as the error message names it."""
    if hint is None or hint is type(None):
        return "None"
    return hint.__name__ if isinstance(hint, type) else re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(hint))
