"""Responses tools as chat's function tools: function tools, namespaces of them, and the built-in tools.

A `namespace` tool groups function tools (Codex sends its sub-agent tools as one). The template is offered
each grouped function under its own name, beside the request's other functions, so names stay unique across
the request; a call the reply makes to a grouped function returns as a `function_call` item carrying the
group's `namespace`, and such an item sent back as input renders as the same call. Built-in (hosted) tools
are refused, or, with the `drop_builtin_tools` setting, left out of the request with one log line naming them.
"""

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.http.finish_log import LOGGED_CHARS, escaped
from deployments.ingress.tool_checks import RESPONSES, check_tools

log = logging.getLogger("tensorfold.ingress")
_INDEX = re.compile(r"tools\[(\d+)\]")  # a function's index in the flattened list
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


@dataclass
class OfferedTools:
    """What a request's `tools` offer the chat template, and what the reply's calls map back to."""

    chat: list[dict[str, Any]] | None  # function tools in chat's shape; None: the request sent no tools
    namespaces: dict[str, str] = field(default_factory=dict)  # a grouped function's name -> its namespace
    dropped: list[str] = field(default_factory=list)  # the built-in tool types left out, in request order


def _refuse(where: str, why: str) -> APIError:
    """A 400 naming the path the client sent (`tools[2].tools[0]`)."""
    return bad_request(f"{where}: {why}", where)


def _namespace_functions(tool: dict[str, Any], at: str) -> list[tuple[str, dict[str, Any]]]:
    """A namespace's function tools, each with its path in the body."""
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise _refuse(f"{at}.name", "a namespace tool needs a name")
    if not isinstance(inner, list) or not inner:
        raise _refuse(f"{at}.tools", "a namespace tool needs a nonempty list of function tools")
    functions = []
    for index, function in enumerate(inner):
        kind = function.get("type", "function") if isinstance(function, dict) else None
        if kind != "function":
            raise _refuse(f"{at}.tools[{index}]", f"a namespace holds function tools, got {kind!r}")
        functions.append((f"{at}.tools[{index}]", function))
    return functions


def _functions(tools: list[Any], drop_builtin: bool) -> tuple[list[tuple[str, dict[str, Any], str | None]], list[str]]:
    """Every function tool with its path and namespace (None: top level), and the built-in types dropped."""
    functions: list[tuple[str, dict[str, Any], str | None]] = []
    dropped: list[str] = []
    spaces: dict[str, str] = {}  # a namespace's name -> its path: a call's namespace must name one group
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append((at, tool, None))
        elif kind == "namespace":
            functions += [(path, inner, tool["name"]) for path, inner in _namespace_functions(tool, at)]
            if tool["name"] in spaces:
                raise _refuse(
                    f"{at}.name",
                    f"{tool['name']!r} is already the name of {spaces[tool['name']]}; namespace names must be unique",
                )
            spaces[tool["name"]] = at
        elif kind == "custom" or not isinstance(kind, str):
            why = f"tools of type {kind!r} are not supported; send function or namespace tools"
            raise _refuse(at, why)
        elif drop_builtin:
            dropped.append(kind)
        else:
            why = f"built-in tools ({kind!r}) are not supported; send function tools, or start the server with "
            why += "--drop-builtin-tools to leave them out"
            raise _refuse(at, why)
    return functions, dropped


def _renamed(text: str, paths: list[str]) -> str:
    return _INDEX.sub(lambda match: paths[int(match.group(1))], text)


def _check(functions: list[tuple[str, dict[str, Any], str | None]]) -> None:
    """The functions checked as OpenAI checks them; a refusal names the paths the client sent."""
    try:
        check_tools([function for _, function, _ in functions], RESPONSES)
    except APIError as exc:
        paths = [path for path, _, _ in functions]
        param = _renamed(exc.param, paths) if exc.param else exc.param
        raise APIError(exc.status, _renamed(exc.message, paths), exc.type, param, exc.code) from None


def offered_tools(tools: list[Any] | None, drop_builtin: bool) -> OfferedTools:
    """Function tools in chat's shape (namespaces flattened); a built-in tool is refused or dropped."""
    if tools is None:
        return OfferedTools(None)
    functions, dropped = _functions(tools, drop_builtin)
    _check(functions)
    if dropped:
        log.info("dropped built-in tools the server does not run: %s", escaped(", ".join(dropped), LOGGED_CHARS))
    chat = [
        {"type": "function", "function": {key: tool[key] for key in _FUNCTION_KEYS if tool.get(key) is not None}}
        for _, tool, _ in functions
    ]
    namespaces = {tool["name"]: space for _, tool, space in functions if space is not None}
    return OfferedTools(chat, namespaces, dropped)
