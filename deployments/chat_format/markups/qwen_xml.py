"""Qwen3-Coder's XML tool-call markup: a function element holding one element per parameter.

`<tool_call>\n<function=name>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>`, as the Qwen3-Coder,
Qwen3.5 and Nemotron 3 templates write it; they differ only between blocks (blank lines, and Nemotron's newline
after every block), which is layout here. Values are raw text between the newlines the template writes around
them, typed by the tool's schema. The templates write scalars with `| string`, so a boolean or null also reads
(and a forced call may write it) in Python's spelling: `True`, `False`, `None`. Qwen3.5's and Nemotron's write
objects and arrays as JSON; Qwen3-Coder's writes them as Python would, which stays a string here.
"""

import re
from typing import TYPE_CHECKING, Any

from deployments.chat_format.markups.base import ToolMarkup
from deployments.chat_format.tool_calls import CALL_NAME, ParsedCall, typed_call

if TYPE_CHECKING:
    import xgrammar as xgr

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _strip_one_newline(value: str) -> str:
    """The template writes values between newlines; those two are markup, the rest is the value."""
    return value.removeprefix("\n").removesuffix("\n")


class QwenXmlMarkup(ToolMarkup):
    name = "qwen_xml"

    def shown_in(self, source: str) -> bool:
        return "<function=" in source

    def parse_calls(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
        match = _FUNCTION.fullmatch(body)
        if match is None or not CALL_NAME.fullmatch(match.group(1).strip()):
            return None
        name, inner = match.group(1).strip(), match.group(2)
        pairs: list[tuple[str, str]] = []
        pos = 0
        while inner[pos:].strip():
            param = _PARAM.match(inner, pos)
            if param is None:
                return None
            pairs.append((param.group(1).strip(), _strip_one_newline(param.group(2))))
            pos = param.end()
        return [typed_call(name, pairs, schemas, python_scalars=True)]

    def close_cut(self, body: str) -> str | None:
        """Closed only between parameters: a value the end token cut may be partial, so it stays content."""
        if body.count("<parameter=") != body.count("</parameter>"):
            return None
        return body if "</function>" in body else body.rstrip() + "\n</function>\n"

    def call_grammar(self, tool: dict[str, Any]) -> "xgr.Grammar":
        from deployments.chat_format.markups import grammar_pieces as g  # xgrammar: only when a call is forced

        def argument(key: str, schema: Any) -> "xgr.Grammar":
            value = g.raw_value(schema, python_scalars=True)
            return g.concat(g.literal(f"<parameter={key}>\n"), value, g.literal("\n</parameter>\n"))

        name, parameters = g.signature(tool)
        return g.concat(
            g.literal(f"{self.call_open}\n<function={name}>\n"),
            *g.arguments(parameters, argument),
            g.literal(f"</function>\n{self.call_close}"),
        )
