"""Where a refusal points: the path of the field it is about, written as the routes write it (docs/api.md).

Paths read like the body: `tools[2].function.parameters`, `messages[1].content[0].image_url.url`. A
validator that finds a problem below the field it checks raises `FieldError` with the path below that
field (`.json_schema.schema`, `[1].content`); the body reader (deployments/ingress/http/errors.py) joins it
to the field's own place in the body, so one validator serves wherever its field sits.
"""

from collections.abc import Iterable
from typing import Any


class FieldError(ValueError):
    """A field's value refused: `below` is the path under the field ("" for the field itself), `why` the
    reason. A ValueError, so pydantic reports it like any validator's error."""

    def __init__(self, below: str, why: str) -> None:
        super().__init__(why)
        self.below = below
        self.why = why


def joined(path: str, below: str) -> str:
    """`path` with `below` (".name", "[0]" or a bare name) after it."""
    if not path:
        return below.removeprefix(".")
    if not below or below.startswith(("[", ".")):
        return path + below
    return f"{path}.{below}"


def written(parts: Iterable[str | int]) -> str:
    """`facts[1].questions[0].answer` from ("facts", 1, "questions", 0, "answer")."""
    path = ""
    for part in parts:
        path = joined(path, f"[{part}]" if isinstance(part, int) else str(part))
    return path


def body_path(body: Any, loc: Iterable[str | int], missing: bool = False) -> str:
    """pydantic's error location as the path into the body the client sent: the parts naming no place in
    it (a union member's tag, say) are left out; `missing`: the last part is a field the body lacks."""
    parts = list(loc)
    kept: list[str | int] = []
    here = body
    for index, part in enumerate(parts):
        if isinstance(here, dict) and part in here:
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here):
            here = here[part]
        elif not (missing and index == len(parts) - 1):
            continue
        kept.append(part)
    return written(kept)
