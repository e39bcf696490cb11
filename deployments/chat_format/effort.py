"""Thinking toggle and reasoning effort as a chat template hears them (the mapping rules below).

- `enable_thinking` set by the caller wins; else `thinking` (true/false or {"type": "enabled"|"disabled"}).
- `reasoning_effort`: the top-level field wins over `chat_template_kwargs.reasoning_effort`; absent, the
  server's `--reasoning-effort`; absent too, nothing is passed and the template renders its own default.
- `none` turns thinking off; any other level turns it on and reaches the template mapped to the nearest
  level the template names (a tie takes the higher one); a template naming no level hears `max` as `xhigh`.
- The template hears an effort only while thinking.
"""

import re
from typing import Any

LEVELS = ("minimal", "low", "medium", "high", "xhigh", "max")  # in increasing order
EFFORT_VALUES = ("none", *LEVELS)


def template_levels(source: str | None) -> tuple[str, ...]:
    """The effort levels a template names as string literals, in increasing order."""
    if not source or "reasoning_effort" not in source:
        return ()
    return tuple(level for level in LEVELS if re.search(rf"""["']{level}["']""", source))


def nearest_level(effort: str, named: tuple[str, ...]) -> str:
    """The level the template hears for `effort` (one of LEVELS)."""
    if effort in named:
        return effort
    if not named:
        return "xhigh" if effort == "max" else effort
    rank = LEVELS.index(effort)
    # Smallest distance first; on a tie the higher level (larger index) wins.
    return min(named, key=lambda level: (abs(LEVELS.index(level) - rank), -LEVELS.index(level)))


def _toggle(value: Any) -> bool | None:
    if isinstance(value, dict):
        value = {"enabled": True, "disabled": False}.get(value.get("type"))  # type: ignore[arg-type]
    return value if isinstance(value, bool) else None


def template_kwargs(
    kwargs: dict[str, Any], effort: str | None, default_effort: str | None, named: tuple[str, ...]
) -> dict[str, Any]:
    """The kwargs the template renders with (a new dict); `effort` is the request's top-level field."""
    out = dict(kwargs)
    explicit = _toggle(out.get("enable_thinking")) if "enable_thinking" in out else _toggle(out.get("thinking"))
    kwarg_effort = out.pop("reasoning_effort", None)
    chosen = effort or (kwarg_effort if kwarg_effort in EFFORT_VALUES else None) or default_effort
    enable = explicit
    if chosen is not None and enable is None:
        enable = chosen != "none"
    if enable is not None:
        out["enable_thinking"] = enable
    if chosen not in (None, "none") and enable is not False:
        out["reasoning_effort"] = nearest_level(chosen, named)
    return out


def check_effort(value: Any, param: str) -> str | None:
    """A request's effort value, or ValueError naming the allowed ones."""
    if value is None:
        return None
    if not isinstance(value, str) or value.strip().lower() not in EFFORT_VALUES:
        raise ValueError(f"{param} must be one of {', '.join(EFFORT_VALUES)}")
    return value.strip().lower()
