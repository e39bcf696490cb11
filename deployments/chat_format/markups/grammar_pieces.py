"""What forced-call grammars are built from (xgrammar): literals, JSON values, XML markups' raw values.

String arguments of the XML-like markups are raw text without `<` (a string enum's values, raw, as the
templates write them); other values are JSON under their property schema. Blanks are bounded as in JSON
grammars: at most MAX_BLANKS between two JSON tokens, and a markup's own line breaks are optional single
newlines, so a model cannot fill its reply with whitespace (a random model otherwise writes blanks until
max_tokens). String arguments are the model's text and stay unbounded, as a JSON string's characters are.

Imported only when a call is forced: xgrammar pulls in transformers.
"""

import json
from collections.abc import Callable
from typing import Any

import xgrammar as xgr

from deployments.chat_format.tool_calls import PYTHON_SCALARS

MAX_BLANKS = 32  # as for response_format: blank characters between two JSON tokens, or between two calls

concat = xgr.Grammar.concat  # the parts one after another
union = xgr.Grammar.union  # any one of the parts


def literal(*pieces: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + " ".join(json.dumps(p, ensure_ascii=False) for p in pieces))


def json_value(schema: Any) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=MAX_BLANKS)


def ebnf(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {text}")


def raw_value(schema: Any, python_scalars: bool = False) -> xgr.Grammar:
    """An XML-like markup's argument: raw text for strings (and string enums), JSON for anything else.

    With `python_scalars`, a boolean or null may also be spelled as Python does (`True`, `False`, `None`):
    the markups whose templates write scalars with `| string` show them so (tool_calls.PYTHON_SCALARS)."""
    choices = _string_choices(schema)
    if choices:
        return union(*(literal(choice) for choice in choices))  # written raw, as a template writes a string
    kind = schema.get("type") if isinstance(schema, dict) and not ({"enum", "const"} & schema.keys()) else None
    if kind == "string":
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")  # length bounds hold on raw text too
        return ebnf("[^<]*" if high is None and not low else f"[^<]{{{low},{'' if high is None else int(high)}}}")
    as_json = json_value(schema if isinstance(schema, dict) else {})
    if not python_scalars or kind not in ("boolean", "null"):
        return as_json
    spellings = [text for text, value in PYTHON_SCALARS.items() if (value is None) == (kind == "null")]
    return union(as_json, *(literal(text) for text in spellings))


def _string_choices(schema: Any) -> list[str]:
    """The values an `enum` or `const` allows when all are strings (empty otherwise)."""
    if not isinstance(schema, dict):
        return []
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else []
    return choices if isinstance(choices, list) and all(isinstance(c, str) for c in choices) else []


def signature(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An offered tool's function name and parameter schema (empty when it gives none)."""
    function = tool.get("function") or {}
    parameters = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    return str(function.get("name", "")), parameters


def arguments(parameters: dict[str, Any], argument: Callable[[str, Any], xgr.Grammar]) -> list[xgr.Grammar]:
    """`argument(key, schema)` for each property in the schema's order; an optional one may be left out."""
    required = set(parameters.get("required") or [])
    pieces: list[xgr.Grammar] = []
    for key, schema in (parameters.get("properties") or {}).items():
        one = argument(key, schema)
        pieces.append(one if key in required else union(one, ebnf('""')))
    return pieces
