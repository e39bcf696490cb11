"""A parsed tool call and how its arguments are typed, shared by every markup family (chat_format/markups/).

A family's parser finds a call's name and its arguments as written; this turns them into what OpenAI's
`function.arguments` carries. Values are typed by the offered tool's schema where it names one explicit
type; anything else stays a string.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

CALL_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")  # what a parsed call's function name may hold
# Python's spelling of scalars, as a template's `{{ value | string }}` writes them (Qwen3.5, Nemotron 3).
PYTHON_SCALARS: dict[str, Any] = {"True": True, "False": False, "None": None}
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {"array": list, "object": dict, "boolean": bool}


@dataclass
class ParsedCall:
    """One tool call read from a reply."""

    name: str  # the function's name, as the reply wrote it (offered or not)
    arguments: str  # a JSON object, as OpenAI's `function.arguments` carries it


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Offered function name -> its parameters' `properties` (possibly empty)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
            props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
            out[function["name"]] = props
    return out


def typed_value(raw: str, schema: Any, python_scalars: bool = False) -> Any:
    """`raw` converted to the schema's one explicit type; malformed or mismatched values stay strings.

    With `python_scalars`, `True`, `False` and `None` are read as JSON's true, false and null too."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(kind, str) or kind == "string":
        return raw  # no type, a union (a list), a $ref or a string: the text as written
    text = raw.strip()
    try:
        value = PYTHON_SCALARS[text] if python_scalars and text in PYTHON_SCALARS else json.loads(text)
    except ValueError:
        return raw
    if kind == "null":
        return value if value is None else raw
    if kind == "integer":  # "3.0" parses as a float, so it stays a string
        return value if isinstance(value, int) and not isinstance(value, bool) else raw
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else raw
    expected = _JSON_TYPES.get(kind)
    return value if expected is not None and isinstance(value, expected) else raw


def typed_call(
    name: str, pairs: list[tuple[str, str]], schemas: dict[str, dict[str, Any]], python_scalars: bool = False
) -> ParsedCall:
    """A call whose arguments were written as raw key/value text (the XML-like markups), typed by its schema."""
    props = schemas.get(name, {})
    arguments = {key: typed_value(value, props.get(key), python_scalars) for key, value in pairs}
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
