"""Structured-output fields to one GrammarSpec: response_format, structured_outputs and vLLM's guided_*.

Every malformed field and every grammar xgrammar cannot parse is a 400 naming the field, before any work;
`tool_choice: "required"` or a named function becomes a grammar over the template's call markup;
the Scheduler compiles the grammar for its tokenizer (cached). Choice lists become an EBNF alternation of
JSON-escaped literals, so any string is matched exactly.
"""

import json
from typing import Any

from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.http.errors import bad_request
from deployments.ingress.request_fields import GenerationFields
from deployments.messages.render import ReplyFormat
from deployments.messages.requests import GrammarSpec

_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, returned as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param}: the schema is not valid JSON ({exc})", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: the schema must be a JSON object", param)
    return json.dumps(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a nonempty string", param)
    return value


def _choice_ebnf(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param} must be a nonempty list of nonempty strings", param)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)


def _from_response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(f'{param}.type must be "text", "json_object" or "json_schema"', param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object" and value.get("schema") is not None:  # as instructor and other clients send one
        return GrammarSpec("json_schema", _schema_text(value["schema"], f"{param}.schema"), param=param)
    if kind == "json_object":
        return GrammarSpec("json_object", "", param=param)
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise bad_request(f"{param}.json_schema.schema is required with type json_schema", param)
    return GrammarSpec("json_schema", _schema_text(inner["schema"], f"{param}.json_schema.schema"), param=param)


def _from_structured_outputs(value: Any) -> GrammarSpec:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"{param} takes exactly one of {', '.join(_STRUCTURED_KEYS)}", param)
    key = given[0]
    if key == "json":
        return GrammarSpec("json_schema", _schema_text(value[key], f"{param}.json"), param=param)
    if key == "json_object":
        if value[key] is not True:
            raise bad_request(f"{param}.json_object must be true", param)
        return GrammarSpec("json_object", "", param=param)
    if key == "regex":
        return GrammarSpec("regex", _text(value[key], f"{param}.regex"), param=param)
    if key == "choice":
        return GrammarSpec("ebnf", _choice_ebnf(value[key], f"{param}.choice"), param=param)
    return GrammarSpec("ebnf", _text(value[key], f"{param}.grammar"), param=param)


def _from_guided(name: str, value: Any) -> GrammarSpec:
    if name == "guided_json":
        return GrammarSpec("json_schema", _schema_text(value, name), param=name)
    if name == "guided_regex":
        return GrammarSpec("regex", _text(value, name), param=name)
    if name == "guided_choice":
        return GrammarSpec("ebnf", _choice_ebnf(value, name), param=name)
    return GrammarSpec("ebnf", _text(value, name), param=name)


def check_compiles(spec: GrammarSpec) -> None:
    """Parse the grammar without a tokenizer, so xgrammar's reason comes back as a 400 at once."""
    import xgrammar as xgr  # imported on first use: it pulls in transformers, which Ingress otherwise skips

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.source)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.source)
    except Exception as exc:  # xgrammar raises several error types, each with its reason
        raise bad_request(f"{spec.param}: the grammar does not compile: {exc}", spec.param) from None


def requested_grammar(fields: GenerationFields) -> GrammarSpec | None:
    """The one grammar a body asks for (None: unconstrained); two structured fields at once are a 400."""
    specs: list[GrammarSpec] = []
    if fields.response_format is not None:
        spec = _from_response_format(fields.response_format)
        if spec is not None:
            specs.append(spec)
    if fields.structured_outputs is not None:
        specs.append(_from_structured_outputs(fields.structured_outputs))
    guided = {
        "guided_json": fields.guided_json,
        "guided_regex": fields.guided_regex,
        "guided_choice": fields.guided_choice,
        "guided_grammar": fields.guided_grammar,
    }
    specs.extend(_from_guided(name, value) for name, value in guided.items() if value is not None)
    if len(specs) > 1:
        names = ", ".join(s.param for s in specs)
        raise bad_request(f"give one structured output field, not several ({names})", specs[1].param)
    if not specs:
        return None
    check_compiles(specs[0])
    return specs[0]


def gate_after_thinking(spec: GrammarSpec, reply: ReplyFormat) -> GrammarSpec:
    """With thinking on, the grammar starts after the think closer (the reply may open a block first)."""
    if reply.think_closer_id is None or reply.enable_thinking is False:
        return spec
    spec.think_closer_id = reply.think_closer_id
    spec.starts_in_think = reply.prompt_opens_thinking
    if not reply.prompt_opens_thinking:
        spec.think_opener_id = reply.think_opener_id
    return spec


def forces_tool_call(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def forced_tool_grammar(fields: ChatCompletionRequest, reply: ReplyFormat) -> GrammarSpec | None:
    """`tool_choice: "required"` or a named function as a grammar over the template's call markup."""
    choice = fields.tool_choice
    if not forces_tool_call(choice):
        return None
    tools = fields.offered_tools
    if not tools:
        what = "the named function is not among the tools" if isinstance(choice, dict) else "no tools are given"
        raise bad_request(f"tool_choice: {what}", "tool_choice")
    from deployments.chat_format.forced_calls import forced_call_ebnf  # imports xgrammar (see check_compiles)

    try:
        source = forced_call_ebnf(tools, reply.tool_format, parallel=fields.parallel_tool_calls is not False)
    except Exception as exc:  # no markup, or a parameter schema xgrammar cannot take
        raise bad_request(f"tool_choice: a call cannot be forced: {exc}", "tool_choice") from None
    return GrammarSpec("ebnf", source, param="tool_choice")
