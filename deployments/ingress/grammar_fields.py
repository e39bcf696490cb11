"""The structured-output fields, typed and checked as the body is parsed: response_format, structured_outputs,
vLLM's guided_*, and the Responses `text.format` that runs as response_format.

Each field's validator checks its shape (a 400 naming the path inside it, `response_format.json_schema.schema`);
the body's model then asks `requested_grammar` for the one GrammarSpec they add up to: at most one field per
request, and a grammar xgrammar parses without a tokenizer, so a malformed or uncompilable grammar is refused
before any work. Choice lists become an EBNF alternation of JSON-escaped literals, so any string is matched
exactly. What needs the rendered prompt is in deployments/ingress/chat_run.py; the Scheduler compiles
the grammar for its vocabulary (cached) when it admits the request.
"""

import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

from deployments.ingress.field_paths import FieldError
from deployments.ingress.http.limits import MAX_JSON_DEPTH, json_depth
from deployments.messages.requests import GrammarSpec

STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
GRAMMAR_FIELDS = (  # in the order a body's fields are read
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
FORMAT_TYPES = ("text", "json_object", "json_schema")
_NULL = {"type": "null"}
_SCHEMA = {"anyOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema, or its JSON text"}
_TEXT = {"type": "string", "minLength": 1}
_CHOICE = {"type": "array", "minItems": 1, "items": _TEXT}


def _schema_text(value: Any, below: str) -> str:
    """A JSON schema given as an object or as JSON text, returned as JSON text. Text is held to the body's
    nesting limit too: xgrammar takes seconds over a schema nested hundreds deep."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:  # malformed, or an integer of more digits than Python reads
            raise FieldError(below, f"the schema is not valid JSON ({exc})") from None
        except RecursionError:
            raise FieldError(below, f"the schema nests deeper than {MAX_JSON_DEPTH} levels") from None
        if json_depth(value) > MAX_JSON_DEPTH:
            raise FieldError(below, f"the schema nests deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(value, dict):
        raise FieldError(below, "the schema must be a JSON object")
    return json.dumps(value)


def _text(value: Any, below: str) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(below, "must be a nonempty string")
    return value


def _choice_ebnf(value: Any, below: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise FieldError(below, "must be a nonempty list of nonempty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)


def response_format_spec(value: Any) -> GrammarSpec | None:
    """Chat's response_format (None: plain text); paths are below the field."""
    param = "response_format"
    if not isinstance(value, dict):
        raise FieldError("", "must be an object with a type")
    if value.get("type") not in FORMAT_TYPES:
        raise FieldError(".type", 'must be "text", "json_object" or "json_schema"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object" and value.get("schema") is not None:  # as instructor and other clients send one
        return GrammarSpec("json_schema", _schema_text(value["schema"], ".schema"), param=param)
    if kind == "json_object":
        return GrammarSpec("json_object", "", param=param)
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise FieldError(".json_schema.schema", "is required with type json_schema")
    return GrammarSpec("json_schema", _schema_text(inner["schema"], ".json_schema.schema"), param=param)


def structured_outputs_spec(value: Any) -> GrammarSpec:
    """vLLM's structured_outputs: exactly one of its keys."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise FieldError("", "must be an object")
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise FieldError("", f"takes exactly one of {', '.join(STRUCTURED_KEYS)}")
    key = given[0]
    if key == "json":
        return GrammarSpec("json_schema", _schema_text(value[key], ".json"), param=param)
    if key == "json_object":
        if value[key] is not True:
            raise FieldError(".json_object", "must be true")
        return GrammarSpec("json_object", "", param=param)
    if key == "regex":
        return GrammarSpec("regex", _text(value[key], ".regex"), param=param)
    if key == "choice":
        return GrammarSpec("ebnf", _choice_ebnf(value[key], ".choice"), param=param)
    return GrammarSpec("ebnf", _text(value[key], ".grammar"), param=param)


def guided_spec(name: str, value: Any) -> GrammarSpec:
    """vLLM's older names: a schema, a regex, a choice list, an EBNF grammar."""
    if name == "guided_json":
        return GrammarSpec("json_schema", _schema_text(value, ""), param=name)
    if name == "guided_regex":
        return GrammarSpec("regex", _text(value, ""), param=name)
    if name == "guided_choice":
        return GrammarSpec("ebnf", _choice_ebnf(value, ""), param=name)
    return GrammarSpec("ebnf", _text(value, ""), param=name)


def text_format_spec(value: Any) -> GrammarSpec | None:
    """Responses' `text` ({"format": {...}}, the schema beside `type`) as the grammar it runs under."""
    if not isinstance(value, dict):
        raise FieldError("", "must be an object or null")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in FORMAT_TYPES:
        raise FieldError(".format.type", 'must be "text", "json_object" or "json_schema"')
    if fmt["type"] != "json_schema":
        return None if fmt["type"] == "text" else GrammarSpec("json_object", "", param="text")
    if "schema" not in fmt:
        raise FieldError(".format.schema", "is required with type json_schema")
    return GrammarSpec("json_schema", _schema_text(fmt["schema"], ".format.schema"), param="text")


@lru_cache(maxsize=256)
def _compile_error(kind: str, source: str) -> str | None:
    """xgrammar's reason a grammar does not parse (no tokenizer needed), or None; a body is parsed more than
    once when another family runs it as chat, so the answer is kept."""
    import xgrammar as xgr  # imported on first use: it pulls in transformers, which Ingress otherwise skips

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(source)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(source)
    except Exception as exc:  # xgrammar raises several error types, each with its reason
        return str(exc)
    return None


def compiled(spec: GrammarSpec | None, below: str = "") -> GrammarSpec | None:
    """`spec`, once xgrammar parses it; else a FieldError with xgrammar's reason."""
    reason = None if spec is None else _compile_error(spec.kind, spec.source)
    if reason is not None:
        raise FieldError(below, f"the grammar does not compile: {reason}")
    return spec


def requested_grammar(fields: Mapping[str, Any]) -> GrammarSpec | None:
    """The one grammar a body's structured-output fields ask for (None: unconstrained), compiled; two fields
    at once are refused, naming the second."""
    specs: list[GrammarSpec] = []
    for name in GRAMMAR_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if name == "response_format":
            spec = response_format_spec(value)
        elif name == "structured_outputs":
            spec = structured_outputs_spec(value)
        else:
            spec = guided_spec(name, value)
        specs += [spec] if spec is not None else []
    if len(specs) > 1:
        names = ", ".join(s.param for s in specs)
        raise FieldError(specs[1].param, f"give one structured output field, not several ({names})")
    return compiled(specs[0], specs[0].param) if specs else None


def _checked(shape: Callable[[Any], object]) -> Callable[[Any], Any]:
    """A BeforeValidator: the value as sent, once `shape` accepts it (null passes)."""

    def check(value: Any) -> Any:
        if value is not None:
            shape(value)
        return value

    return check


def _nullable(schema: dict[str, Any]) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [schema, _NULL], "default": None})


_FORMAT_SCHEMA = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": list(FORMAT_TYPES)},
        "json_schema": {
            "type": "object",
            "required": ["schema"],
            "properties": {"name": {"type": "string"}, "schema": _SCHEMA, "strict": {"type": ["boolean", "null"]}},
        },
        "schema": _SCHEMA,
    },
}
_TEXT_FORMAT_SCHEMA = {  # Responses': the schema beside the type, not inside a json_schema object
    "type": "object",
    "properties": {
        "format": {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": list(FORMAT_TYPES)}, "name": {"type": "string"}, "schema": _SCHEMA},
        }
    },
}
_STRUCTURED_SCHEMA = {
    "type": "object",
    "description": "exactly one of its keys",
    "properties": {
        "json": _SCHEMA,
        "json_object": {"const": True},
        "regex": _TEXT,
        "choice": _CHOICE,
        "grammar": _TEXT,
    },
}
ResponseFormat = Annotated[
    dict[str, Any] | None, BeforeValidator(_checked(response_format_spec)), _nullable(_FORMAT_SCHEMA)
]
StructuredOutputs = Annotated[
    dict[str, Any] | None, BeforeValidator(_checked(structured_outputs_spec)), _nullable(_STRUCTURED_SCHEMA)
]
GuidedJson = Annotated[
    dict[str, Any] | str | None, BeforeValidator(_checked(lambda v: guided_spec("guided_json", v))), _nullable(_SCHEMA)
]
GuidedText = Annotated[str | None, BeforeValidator(_checked(lambda v: _text(v, ""))), _nullable(_TEXT)]
GuidedChoice = Annotated[list[str] | None, BeforeValidator(_checked(lambda v: _choice_ebnf(v, ""))), _nullable(_CHOICE)]
TextFormat = Annotated[
    dict[str, Any] | None,
    BeforeValidator(_checked(lambda v: compiled(text_format_spec(v), ".format.schema"))),
    _nullable(_TEXT_FORMAT_SCHEMA),
]
