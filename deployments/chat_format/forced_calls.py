"""Forced tool calls as a grammar over the chat template's own call markup (GLM, Qwen XML, Hermes JSON).

With `tool_choice: "required"` or a named function, the answer is one or more calls (exactly one when
`parallel_tool_calls` is false), each to an offered tool (the named one only), with arguments inside the
tool's parameter schema; blank lines may separate calls, prose may not. Parsing the reply stays the reply
parser's job: this only constrains generation. String arguments of the XML markups are raw text without
`<`; other values are JSON under their property schema.

Blanks are bounded as in JSON grammars: at most 32 between two calls and between two JSON tokens, and the
markup's own line breaks are optional single newlines, so a model cannot fill its reply with whitespace
(a random model otherwise writes blanks between calls until max_tokens). String arguments are the model's
text and stay unbounded, as a JSON string's characters are.
"""

import json
import re
from typing import Any

import xgrammar as xgr

from deployments.chat_format.tool_format import GLM, HERMES, QWEN_XML

MAX_BLANKS = 32  # as for response_format: blank characters between two JSON tokens, or between two calls


def _lit(*pieces: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + " ".join(json.dumps(p, ensure_ascii=False) for p in pieces))


def _json(schema: Any) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=MAX_BLANKS)


def _ebnf(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {text}")


def _value(schema: Any) -> xgr.Grammar:
    """An XML-markup argument: raw text for strings, JSON for anything else."""
    if isinstance(schema, dict) and schema.get("type") == "string" and not ({"enum", "const"} & schema.keys()):
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")  # length bounds hold on raw text too
        return _ebnf("[^<]*" if high is None and not low else f"[^<]{{{low},{'' if high is None else int(high)}}}")
    return _json(schema if isinstance(schema, dict) else {})


def _arguments(parameters: dict[str, Any], markup: str) -> list[xgr.Grammar]:
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    pieces: list[xgr.Grammar] = []
    for key, schema in properties.items():
        if markup == GLM:
            one = xgr.Grammar.concat(_ebnf('"\\n"? ' + json.dumps(f"<arg_key>{key}</arg_key>")), _ebnf('"\\n"?'),
                                     _lit("<arg_value>"), _value(schema), _lit("</arg_value>"))  # fmt: skip
        else:
            one = xgr.Grammar.concat(_lit(f"<parameter={key}>\n"), _value(schema), _lit("\n</parameter>\n"))
        pieces.append(one if key in required else xgr.Grammar.union(one, _ebnf('""')))
    return pieces


def _call(tool: dict[str, Any], markup: str) -> xgr.Grammar:
    function = tool.get("function") or {}
    name = str(function.get("name", ""))
    parameters = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    if markup == HERMES:
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters or {}},
                  "required": ["name", "arguments"]}  # fmt: skip
        return xgr.Grammar.concat(_lit("<tool_call>\n"), _json(schema),
                                  _lit("\n</tool_call>"))  # fmt: skip
    if markup == GLM:
        return xgr.Grammar.concat(_lit(f"<tool_call>{name}"), *_arguments(parameters, GLM),
                                  _ebnf('"\\n"? "</tool_call>"'))  # fmt: skip
    return xgr.Grammar.concat(_lit(f"<tool_call>\n<function={name}>\n"), *_arguments(parameters, QWEN_XML),
                              _lit("</function>\n</tool_call>"))  # fmt: skip


def forced_call_ebnf(tools: list[dict[str, Any]], markup: str | None, parallel: bool) -> str:
    """The EBNF of a reply made of calls to `tools` in `markup` (ValueError for a template without one)."""
    if markup not in (GLM, QWEN_XML, HERMES):
        raise ValueError("this model's chat template shows no tool-call markup, so a call cannot be forced")
    if not tools:
        raise ValueError("no tools are offered")
    calls = [_call(tool, markup) for tool in tools]
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    body = re.sub(r"^root ::=", "forced_call ::=", str(one), flags=re.M)  # a rule the new root repeats
    between = f"[ \\n]{{0,{MAX_BLANKS}}}"  # blank lines may separate calls, up to the JSON bound
    root = f"root ::= forced_call ({between} forced_call)*" if parallel else "root ::= forced_call"
    return f"{root}\n{body}"
