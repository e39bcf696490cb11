"""Gemma 4's tool-call markup: `<|tool_call>call:name{key:value,...}<tool_call|>`, values in its own syntax.

The template writes arguments with sorted keys and no blanks: strings between `<|"|>` quotes, booleans as
`true`/`false`, objects as `{key:value,...}` (keys bare), arrays as `[value,...]`, numbers as written and
null as `None`. Values are typed by that syntax, not by the schema: a bare word the model writes unquoted
reads as a string. After a turn's calls the template writes `<|tool_response>` where another turn would end:
a reply that reaches it has ended (ToolMarkup.turn_end).
"""

import json
from typing import TYPE_CHECKING, Any

from deployments.chat_format.markups.base import ToolMarkup
from deployments.chat_format.markups.gemma_values import QUOTE, ValueSyntaxError, read_call
from deployments.chat_format.tool_calls import CALL_NAME, ParsedCall

if TYPE_CHECKING:
    import xgrammar as xgr


class GemmaMarkup(ToolMarkup):
    name = "gemma"
    call_open = "<|tool_call>"
    call_close = "<tool_call|>"
    turn_end = "<|tool_response>"

    def parse_calls(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
        try:
            name, arguments = read_call(body)
        except ValueSyntaxError:
            return None
        if not CALL_NAME.fullmatch(name):
            return None
        return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False))]

    def close_cut(self, body: str) -> str | None:
        """Closed only when the arguments' braces are: a value the end token cut may be partial."""
        return body if body.rstrip().endswith("}") and body.count(QUOTE) % 2 == 0 else None

    def call_grammar(self, tool: dict[str, Any]) -> "xgr.Grammar":
        from deployments.chat_format.markups.gemma_grammar import call_grammar  # xgrammar: only when forced

        return call_grammar(self.call_open, self.call_close, tool)
