"""A chat reply's parsed parts in OpenAI's shapes: stream deltas and the finished message.

Reasoning goes out as `reasoning_content` and, for vLLM clients, also as `reasoning`. A streamed call
arrives as a delta with its id, type and name, then one with its arguments; calls get `call_...` ids.
"""

import uuid
from dataclasses import dataclass
from typing import Any

from deployments.chat_format.reply_parser import ReplyDelta, ReplyReader
from deployments.chat_format.tool_calls import ParsedCall


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_object(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ChatReply(ReplyReader):
    """One chat reply's parsing state for its OpenAI framer (streamed or whole)."""

    has_calls: bool = False  # the reply made a tool call, so it finishes with "tool_calls"

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.has_calls and finish != "length" else finish  # a cut reply stays "length"

    # ---- streamed ---------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.read(text))

    def flush(self, finish: str, token_ids: list[int]) -> list[dict[str, Any]]:
        return self._deltas(self.read_end(finish, token_ids))

    def _deltas(self, delta: ReplyDelta) -> list[dict[str, Any]]:
        """The `delta` objects for one parser step, in reply order: reasoning, content, calls."""
        out: list[dict[str, Any]] = []
        if delta.reasoning:
            out.append({"reasoning_content": delta.reasoning, "reasoning": delta.reasoning})
        if delta.content:
            out.append({"content": delta.content})
        for index, call in delta.calls:
            self.has_calls = True
            head = {
                "index": index,
                "id": _call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return out

    # ---- whole ------------------------------------------------------------------------------------------
    def message(self, text: str, finish: str, token_ids: list[int]) -> dict[str, Any]:
        view = self.whole(text, finish, token_ids)
        self.has_calls = bool(view.calls)
        message: dict[str, Any] = {"role": "assistant", "content": view.content or (None if view.calls else "")}
        if view.reasoning is not None:
            message["reasoning_content"] = view.reasoning
            message["reasoning"] = view.reasoning
        if view.calls:
            message["tool_calls"] = [_call_object(call, _call_id()) for call in view.calls]
        return message
