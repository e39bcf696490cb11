"""A chat reply framed as an Anthropic message: the JSON body and the typed SSE stream.

Content blocks come in reply order: a `thinking` block (plaintext, empty signature), a `text` block, then
one `tool_use` block per call. A stream opens with `message_start` and a `ping`, sends each block as
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason and the final usage) and `message_stop`. A failure
after the stream opened is an `error` event in Anthropic's envelope.
"""

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from deployments.chat_format.reply_parser import ReplyDelta
from deployments.chat_format.tool_calls import ParsedCall
from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.chat_run import ChatRun
from deployments.ingress.usage import ReplySummary


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def sse(event: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n".encode()


def error_event(error_type: str, message: str) -> bytes:
    return sse("error", {"type": "error", "error": {"type": error_type, "message": message}})


def usage(summary: ReplySummary) -> dict[str, Any]:
    """Uncached input apart from cache reads; cache_control never creates anything, so creation is 0."""
    stats = summary.stats
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": stats.cached_tokens,
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"thinking_tokens": summary.reasoning_tokens},
    }


def stop_reason(finish: str, has_calls: bool, summary: ReplySummary) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a call wins, then the token limit, then a matched stop sequence."""
    if has_calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if summary.stats.stop_string is not None:
        return "stop_sequence", summary.stats.stop_string
    return "end_turn", None


def _tool_block(call: ParsedCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": json.loads(call.arguments)}


class MessagesFramer:
    def __init__(self, run: ChatRun, model: str) -> None:
        self.run = run
        self.model = model
        self.message_id = run.generation.request_id
        self.reader = run.reader()

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }

    # ---- whole ------------------------------------------------------------------------------------------
    async def body(self) -> dict[str, Any]:
        """The whole message (raises GenerationFailed for the route to answer 500)."""
        generation = self.run.generation
        text, _ = await generation.collect()
        summary, finish = generation.summary, generation.finish_reason
        assert summary is not None and finish is not None
        view = self.reader.whole(text, finish, summary.token_ids)
        content: list[dict[str, Any]] = []
        if view.reasoning is not None:
            content.append({"type": "thinking", "thinking": view.reasoning, "signature": ""})
        if view.content or not (view.calls or content):
            content.append({"type": "text", "text": view.content})
        content.extend(_tool_block(call) for call in view.calls)
        body = self._message(content, *stop_reason(finish, bool(view.calls), summary))
        body["usage"] = usage(summary)
        body["tensorfold"] = summary.runtime_block()
        return body

    # ---- streamed ---------------------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[bytes]:
        generation = self.run.generation
        blocks = _BlockStream()
        try:
            start = self._message([], None, None)
            prompt, cached = len(generation.request.prompt_token_ids), generation.cached_tokens
            start["usage"] = {
                "input_tokens": prompt - cached,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": 0,
            }
            yield sse("message_start", {"type": "message_start", "message": start})
            yield sse("ping", {"type": "ping"})
            async for chunk in generation.chunks():
                for event in blocks.feed(self.reader.read(chunk.text)):
                    yield event
                if chunk.finished:
                    summary, finish = generation.summary, generation.finish_reason
                    assert summary is not None and finish is not None
                    for event in blocks.feed(self.reader.read_end(finish, summary.token_ids)) + blocks.close():
                        yield event
                    reason, sequence = stop_reason(finish, blocks.has_calls, summary)
                    delta = {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(summary),
                        "tensorfold": summary.runtime_block(),
                    }
                    yield sse("message_delta", delta)
                    yield sse("message_stop", {"type": "message_stop"})
        except GenerationFailed as exc:
            yield error_event("api_error", str(exc))
        finally:
            await generation.close()  # the client left before the reply settled: cancel it upstream


class _BlockStream:
    """Turns parser deltas into content-block events, opening and closing blocks as the kind changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        self.has_calls = False

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.open_kind = block["type"]
        events.append(
            sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        """Stop the open block (a thinking block first gets its empty signature)."""
        if self.open_kind is None:
            return []
        events = []
        if self.open_kind == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open_kind = None
        return events

    def feed(self, delta: ReplyDelta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning:
            if self.open_kind != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.open_kind != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for _, call in delta.calls:
            self.has_calls = True
            events += self._start({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            events += self.close()
        return events
