"""Tool-call markup as checkpoints write it: GLM, Qwen XML (Qwen3-Coder) and Hermes JSON (Qwen3).

Every format wraps a call in `<tool_call>...</tool_call>`; what differs is the body. `parse_call` turns one
body into a `ParsedCall` or None (None keeps the block's text as content, never an error). Values are
typed by the offered tool's schema where it names one explicit type; anything else stays a string.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from deployments.chat_format.tool_format import GLM, QWEN_XML

_GLM_PAIR = re.compile(r"\s*(?:<arg_key>)?(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_QWEN_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {"array": list, "object": dict, "boolean": bool}


@dataclass
class ParsedCall:
    name: str
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


def typed_value(raw: str, schema: Any) -> Any:
    """`raw` converted to the schema's one explicit type; malformed or mismatched values stay strings."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(kind, str) or kind == "string":
        return raw  # no type, a union (a list), a $ref or a string: the text as written
    text = raw.strip()
    try:
        value = json.loads(text)
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


def _arguments(pairs: list[tuple[str, str]], props: dict[str, Any]) -> str:
    return json.dumps({key: typed_value(value, props.get(key)) for key, value in pairs}, ensure_ascii=False)


def _parse_glm(body: str, schemas: dict[str, dict[str, Any]]) -> ParsedCall | None:
    first_key = body.find("<arg_key>")
    first_close = body.find("</arg_key>")
    if first_close >= 0 and (first_key < 0 or first_key > first_close):
        # The first key lost its <arg_key>: the name is the first line, the key the rest (the tag comes back).
        head, sep, rest = body.partition("\n")
        if not sep:
            return None
        body = head + "<arg_key>" + rest.lstrip()
        first_key = len(head)
    name = (body if first_key < 0 else body[:first_key]).strip()
    if not _NAME.fullmatch(name):
        return None
    pairs: list[tuple[str, str]] = []
    pos = len(body) if first_key < 0 else first_key
    while pos < len(body) and body[pos:].strip():
        match = _GLM_PAIR.match(body, pos)
        if match is None or not match.group(1).strip() or "<arg_" in match.group(1):
            return None
        pairs.append((match.group(1).strip(), match.group(2)))
        pos = match.end()
    return ParsedCall(name, _arguments(pairs, schemas.get(name, {})))


def _strip_one_newline(value: str) -> str:
    """The template writes values between newlines; those two are markup, the rest is the value."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _parse_qwen_xml(body: str, schemas: dict[str, dict[str, Any]]) -> ParsedCall | None:
    match = _QWEN_FUNCTION.fullmatch(body)
    if match is None or not _NAME.fullmatch(match.group(1).strip()):
        return None
    name, inner = match.group(1).strip(), match.group(2)
    pairs: list[tuple[str, str]] = []
    pos = 0
    while inner[pos:].strip():
        param = _QWEN_PARAM.match(inner, pos)
        if param is None:
            return None
        pairs.append((param.group(1).strip(), _strip_one_newline(param.group(2))))
        pos = param.end()
    return ParsedCall(name, _arguments(pairs, schemas.get(name, {})))


def _parse_hermes(body: str) -> ParsedCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not _NAME.fullmatch(data["name"]):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(data["name"], json.dumps(args, ensure_ascii=False))


def parse_call(body: str, fmt: str, schemas: dict[str, dict[str, Any]]) -> ParsedCall | None:
    """One call from the text between `<tool_call>` and `</tool_call>`; None when it is not one."""
    if fmt == GLM:
        return _parse_glm(body, schemas)
    if fmt == QWEN_XML:
        return _parse_qwen_xml(body, schemas)
    return _parse_hermes(body)


def close_cut_call(body: str, fmt: str) -> str | None:
    """A body an end token cut off, with its markup closed where the manual allows (None: leave it)."""
    if fmt == GLM:
        if body.count("<arg_value>") > body.count("</arg_value>"):
            return body + "</arg_value>"
        return body
    if fmt == QWEN_XML:
        if body.count("<parameter=") != body.count("</parameter>"):
            return None  # a partial value stays content
        return body if "</function>" in body else body.rstrip() + "\n</function>\n"
    return body
