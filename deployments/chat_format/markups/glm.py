"""GLM's tool-call markup (GLM-4.5 to 4.7, tiny-glm): the name, then key/value pairs.

`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`, compact (GLM-4.7) or with a
newline before each tag (GLM-4.5/4.6). Values are raw text, typed by the tool's schema.
"""

import json
import re
from typing import TYPE_CHECKING, Any

from deployments.chat_format.markups.base import ToolMarkup
from deployments.chat_format.tool_calls import CALL_NAME, ParsedCall, typed_call

if TYPE_CHECKING:
    import xgrammar as xgr

_PAIR = re.compile(r"\s*(?:<arg_key>)?(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GlmMarkup(ToolMarkup):
    name = "glm"

    def shown_in(self, source: str) -> bool:
        return "<arg_key>" in source

    def parse_calls(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
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
        if not CALL_NAME.fullmatch(name):
            return None
        pairs: list[tuple[str, str]] = []
        pos = len(body) if first_key < 0 else first_key
        while pos < len(body) and body[pos:].strip():
            match = _PAIR.match(body, pos)
            if match is None or not match.group(1).strip() or "<arg_" in match.group(1):
                return None
            pairs.append((match.group(1).strip(), match.group(2)))
            pos = match.end()
        return [typed_call(name, pairs, schemas)]

    def close_cut(self, body: str) -> str | None:
        """A value the end token cut gets its close tag: the value is the text written so far."""
        if body.count("<arg_value>") > body.count("</arg_value>"):
            return body + "</arg_value>"
        return body

    def call_grammar(self, tool: dict[str, Any]) -> "xgr.Grammar":
        from deployments.chat_format.markups import grammar_pieces as g  # xgrammar: only when a call is forced

        def argument(key: str, schema: Any) -> "xgr.Grammar":
            return g.concat(
                g.ebnf('"\\n"? ' + json.dumps(f"<arg_key>{key}</arg_key>")),
                g.ebnf('"\\n"?'),
                g.literal("<arg_value>"),
                g.raw_value(schema),
                g.literal("</arg_value>"),
            )

        name, parameters = g.signature(tool)
        return g.concat(
            g.literal(self.call_open + name),
            *g.arguments(parameters, argument),
            g.ebnf('"\\n"? ' + json.dumps(self.call_close)),
        )
