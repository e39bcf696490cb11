"""Hermes JSON tool-call markup (Qwen3): one JSON object per call, `{"name": ..., "arguments": {...}}`.

`<tool_call>\n{"name": "f", "arguments": {"k": "v"}}\n</tool_call>`. Arguments written as a JSON string, or
under "parameters", are read too. Any template showing `<tool_call>` without another family's marks is this.
"""

import json
from typing import TYPE_CHECKING, Any

from deployments.chat_format.markups.base import ToolMarkup
from deployments.chat_format.tool_calls import CALL_NAME, ParsedCall

if TYPE_CHECKING:
    import xgrammar as xgr


def _json_or_none(text: str) -> Any:
    """The JSON value `text` holds; None when it holds none (a call's body or arguments then do not parse)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


class HermesMarkup(ToolMarkup):
    name = "hermes"

    def parse_calls(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
        data = _json_or_none(body)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not CALL_NAME.fullmatch(data["name"]):
            return None
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            args = _json_or_none(args)
        if not isinstance(args, dict):
            return None
        return [ParsedCall(data["name"], json.dumps(args, ensure_ascii=False))]  # JSON is typed as written

    def call_grammar(self, tool: dict[str, Any]) -> "xgr.Grammar":
        from deployments.chat_format.markups import grammar_pieces as g  # xgrammar: only when a call is forced

        name, parameters = g.signature(tool)
        schema = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or {}},
            "required": ["name", "arguments"],
        }
        return g.concat(g.literal(self.call_open + "\n"), g.json_value(schema), g.literal("\n" + self.call_close))
