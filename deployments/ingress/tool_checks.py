"""Function tool definitions checked as each API's vendor checks them, before anything is rendered.

A tool needs a name of letters, digits, underscores and hyphens (at most 64 characters on the OpenAI
routes, OpenAI's rule; 128 on Anthropic Messages, Anthropic's), unique among the request's tools, and a
parameter schema that is an object schema: a JSON object whose `type`, when given, is "object". Each
refusal names the offending field by its path in the body the client sent (`tools[0].function.name` in
chat, `tools[0].name` in Responses and Messages), as `param` where the route's envelope carries one.
Duplicate names are refused on every route: a call names its tool, so two tools under one name would
leave the call (and a forced call's grammar) ambiguous; Anthropic refuses them as well.
"""

import re
from dataclasses import dataclass
from typing import Any

from deployments.ingress.http.errors import APIError, bad_request

NAME_CHARS = re.compile(r"[a-zA-Z0-9_-]+")


@dataclass(frozen=True)
class ToolShape:
    """Where one API family keeps a function tool's fields."""

    nested: str | None  # the key holding name and schema ("function" in chat); None: on the tool itself
    tool_type: str | None  # the only `type` a tool may give (when absent, as vLLM reads it); None: not checked here
    schema_key: str  # "parameters", or Anthropic's "input_schema"
    schema_required: bool  # Anthropic requires input_schema; OpenAI's parameters may be omitted
    max_name_chars: int


CHAT = ToolShape("function", "function", "parameters", schema_required=False, max_name_chars=64)
# Responses and Messages refuse their built-in and server-side tool types while translating, first.
RESPONSES = ToolShape(None, None, "parameters", schema_required=False, max_name_chars=64)
MESSAGES = ToolShape(None, None, "input_schema", schema_required=True, max_name_chars=128)


def _kind(value: Any) -> str:
    """A JSON type's name for a value, as error messages say it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _refuse(path: str, why: str) -> APIError:
    return bad_request(f"{path}: {why}", path)


def _check_name(name: Any, path: str, limit: int) -> str:
    if name is None:
        raise _refuse(path, "is required: every function tool needs a name")
    if not isinstance(name, str):
        raise _refuse(path, f"must be a string, got {_kind(name)}")
    if len(name) > limit:
        raise _refuse(path, f"is {len(name)} characters long; a tool name holds at most {limit}")
    if not NAME_CHARS.fullmatch(name):
        raise _refuse(
            path,
            f"{name!r} does not match the pattern '^[a-zA-Z0-9_-]{{1,{limit}}}$' "
            "(letters, digits, underscores and hyphens)",
        )
    return name


def _check_schema(schema: Any, path: str, required: bool) -> None:
    if schema is None and not required:
        return  # OpenAI: no parameters is a function without arguments
    if not isinstance(schema, dict):
        raise _refuse(path, f"must be a JSON Schema object, got {_kind(schema)}")
    kind = schema.get("type", "object")
    if kind != "object":
        raise _refuse(path, f"must be an object schema: its type is {kind!r}, and only 'object' is accepted")


def _check_optional(fields: dict[str, Any], at: str) -> None:
    description, strict = fields.get("description"), fields.get("strict")
    if description is not None and not isinstance(description, str):
        raise _refuse(f"{at}.description", f"must be a string, got {_kind(description)}")
    if strict is not None and not isinstance(strict, bool):
        raise _refuse(f"{at}.strict", f"must be a boolean, got {_kind(strict)}")


def check_tools(tools: Any, shape: ToolShape) -> None:
    """Refuse (400, naming the field's path) the first tool a vendor would refuse; None and [] pass."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _refuse("tools", f"must be an array of tools, got {_kind(tools)}")
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _refuse(at, f"must be an object, got {_kind(tool)}")
        if shape.tool_type is not None and tool.get("type", shape.tool_type) != shape.tool_type:
            raise _refuse(f"{at}.type", f"must be {shape.tool_type!r}, got {tool['type']!r}")
        fields = tool
        if shape.nested is not None:
            fields = tool.get(shape.nested)
            at = f"{at}.{shape.nested}"
            if fields is None:
                raise _refuse(at, "is required: a function tool holds its name and parameters there")
            if not isinstance(fields, dict):
                raise _refuse(at, f"must be an object, got {_kind(fields)}")
        name = _check_name(fields.get("name"), f"{at}.name", shape.max_name_chars)
        _check_schema(fields.get(shape.schema_key), f"{at}.{shape.schema_key}", shape.schema_required)
        _check_optional(fields, at)
        if name in seen:
            why = f"{name!r} is already the name of tools[{seen[name]}]; tool names must be unique"
            raise _refuse(f"{at}.name", why)
        seen[name] = index
