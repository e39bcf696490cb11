"""Validators for the numeric and flag fields every generation route shares.

As docs/api.md says: malformed temperature, top_p, top_k, min_p and seed values get HTTP 400 whether or not the
request samples: booleans, non-finite numbers, non-numeric strings, and non-integral top_k or seed;
min_p outside 0..1; a non-boolean ignore_eos; a malformed stop. Numeric strings ("0.7") are numbers, as
lax JSON clients send them; null keeps the server default. Pydantic's own coercion would accept booleans
and infinities, so these run before it (BeforeValidator) and return plain Python values.
"""

import math
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def _as_number(value: Any, name: str) -> float:
    """A finite float from a JSON number or numeric string; booleans and everything else are refused."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, not a boolean")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    else:
        raise ValueError(f"{name} must be a number")
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number")
    return number


def _as_integer(value: Any, name: str) -> int:
    """An integer from a JSON integer, an integral float (3.0) or an integer string; nothing fractional."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass  # "3.0" and "1e3" fall through to the float rules
    number = _as_number(value, name)
    if not number.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(number)


def float_field(
    name: str, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Callable[[Any], float | None]:
    """A BeforeValidator for a bounded float field (None passes through as 'server default')."""

    def check(value: Any) -> float | None:
        if value is None:
            return None
        number = _as_number(value, name)
        if low is not None and (number < low or (low_open and number == low)):
            raise ValueError(f"{name} must be {'greater than' if low_open else 'at least'} {low:g}, got {number:g}")
        if high is not None and number > high:
            raise ValueError(f"{name} must be at most {high:g}, got {number:g}")
        return number

    return check


def int_field(name: str, low: int | None = None, high: int | None = None) -> Callable[[Any], int | None]:
    """A BeforeValidator for an integer field (None passes through)."""

    def check(value: Any) -> int | None:
        if value is None:
            return None
        number = _as_integer(value, name)
        if low is not None and number < low:
            raise ValueError(f"{name} must be at least {low}, got {number}")
        if high is not None and number > high:
            raise ValueError(f"{name} must be at most {high}, got {number}")
        return number

    return check


def bool_field(name: str) -> Callable[[Any], bool | None]:
    """A JSON boolean or null; strings and numbers are refused rather than guessed."""

    def check(value: Any) -> bool | None:
        if value is None or isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be a boolean, got {value!r}")

    return check


def stop_field(value: Any) -> list[str]:
    """`stop`: null, a string, or a list of strings; each nonempty."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("stop must be a string or a list of strings")
    if any(s == "" for s in items):
        raise ValueError("stop strings must be nonempty")
    return list(items)


_STOP_STRING = {"type": "string", "minLength": 1}
# What stop_field takes, as the OpenAPI document shows it (a plain list[str] would hide the string form).
StopField = Annotated[
    list[str],
    BeforeValidator(stop_field),
    WithJsonSchema({"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING}, {"type": "null"}]}),
]


def token_ids_field(name: str, nullable: bool = True) -> Callable[[Any], list[int]]:
    """A list of non-negative integer token ids (null = empty where `nullable`, else refused)."""

    def check(value: Any) -> list[int]:
        if value is None and nullable:
            return []
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError(f"{name} must be a list of integer token ids")
        if any(t < 0 for t in value):
            raise ValueError(f"{name} must not hold negative ids")
        return list(value)

    return check
