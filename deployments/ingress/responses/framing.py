"""Response objects and the typed event stream, from one chat reply's parsed parts.

Output holds, in reply order, a reasoning item (its text as reasoning_text content, an empty summary), a
message with output_text, and function_call items. A stream opens each item as its first text is parsed
and closes it when the next begins, so the joined deltas equal the whole reply's texts; every event
carries the next `sequence_number`, from 0.
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.chat_format.reply_parser import ReplyDelta, ReplyView
from deployments.chat_format.tool_calls import ParsedCall
from deployments.ingress.usage import ReplySummary


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def typed_event(payload: dict[str, Any]) -> bytes:
    """One SSE event as OpenAI sends Responses events: its type on the `event:` line, then its JSON."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


def responses_usage(summary: ReplySummary) -> dict[str, Any]:
    stats = summary.stats
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": summary.reasoning_tokens},
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(
    call: ParsedCall, arguments: str, status: str, item_id: str, call_id: str, namespaces: dict[str, str]
) -> dict[str, Any]:
    """A function_call item; a call to a function offered from a namespace tool carries that `namespace`."""
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }
    if call.name in namespaces:
        item["namespace"] = namespaces[call.name]
    return item


def _new_call(call: ParsedCall, namespaces: dict[str, str]) -> dict[str, Any]:
    return call_item(call, call.arguments, "completed", new_id("fc"), new_id("call"), namespaces)


def whole_output(view: ReplyView, cut: bool, namespaces: dict[str, str]) -> list[dict[str, Any]]:
    """A finished reply's output items; a reply cut by the token limit leaves its last text item incomplete.
    `namespaces`: which namespace each function offered from a namespace tool belongs to."""
    items: list[dict[str, Any]] = []
    if view.reasoning is not None:
        items.append(reasoning_item(new_id("rs"), view.reasoning, "completed"))
    if view.content:
        items.append(message_item(new_id("msg"), view.content, "completed"))
    items.extend(_new_call(call, namespaces) for call in view.calls)
    if cut and items and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"
    return items


@dataclass
class ResponseHead:
    """What every Response object of one request repeats (the request's settings, echoed)."""

    response_id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    namespaces: dict[str, str] = field(default_factory=dict)  # a function offered from a namespace -> its name

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        summary: ReplySummary | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            **self.echo,
            "usage": None,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed":
            body["completed_at"] = int(time.time())
        if summary is not None:
            body["usage"] = responses_usage(summary)
            body["tensorfold"] = summary.runtime_block()
        return body


class _OpenItem:
    """The item a stream is writing into: reasoning or message text."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index
        self.id = new_id("rs" if kind == "reasoning" else "msg")
        self.text = ""

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        maker = reasoning_item if self.kind == "reasoning" else message_item
        return maker(self.id, text, status)

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}


class ResponseEvents:
    """The typed events of one streamed response; `output` collects the finished items."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: _OpenItem | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _where(self, item: _OpenItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    def opening(self) -> list[dict[str, Any]]:
        pending = self.head.body("in_progress", [])
        return [
            self._event("response.created", response=pending),
            self._event("response.in_progress", response=pending),
        ]

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        events = self.close_item("completed")
        item = self._open = _OpenItem(kind, len(self.output))
        events.append(
            self._event("response.output_item.added", output_index=item.index, item=item.item("in_progress", None))
        )
        events.append(self._event("response.content_part.added", **self._where(item), part=item.part("")))
        return events

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events = [] if self._open is not None and self._open.kind == kind else self._open_item(kind)
        assert self._open is not None
        self._open.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, **self._where(self._open), delta=delta, **extra))
        return events

    def close_item(self, status: str) -> list[dict[str, Any]]:
        """The .done events of the item being written (none when no item is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        name = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
        extra = {} if item.kind == "reasoning" else {"logprobs": []}
        done = item.item(status, item.text)
        self.output.append(done)
        return [
            self._event(name, **self._where(item), text=item.text, **extra),
            self._event("response.content_part.done", **self._where(item), part=item.part(item.text)),
            self._event("response.output_item.done", output_index=item.index, item=done),
        ]

    def _call(self, call: ParsedCall) -> list[dict[str, Any]]:
        events = self.close_item("completed")
        index, done = len(self.output), _new_call(call, self.head.namespaces)
        where = {"item_id": done["id"], "output_index": index}
        opened = call_item(call, "", "in_progress", done["id"], done["call_id"], self.head.namespaces)
        self.output.append(done)
        return events + [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=done),
        ]

    def feed(self, delta: ReplyDelta) -> list[dict[str, Any]]:
        """The events one parser step produces, in reply order: reasoning, content, calls."""
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for _, call in delta.calls:
            events += self._call(call)
        return events

    def finished(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=body)

    def failed(self, message: str) -> list[dict[str, Any]]:
        """Close the open item as incomplete, then `response.failed` with what was written so far."""
        events = self.close_item("incomplete")
        error = {"code": "server_error", "message": message}
        return events + [self._event("response.failed", response=self.head.body("failed", self.output, error=error))]
