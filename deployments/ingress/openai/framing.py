"""OpenAI chat and text-completion bodies, JSON and streamed, from one Generation.

Stream shape (docs/api.md): each event is a chunk object; the finish event carries `finish_reason`, and
usage with the `tensorfold` runtime block rides on it, unless `stream_options.include_usage` asks for
usage in its own final event with `"choices": []` (then every earlier chunk has `"usage": null`, as
OpenAI sends it). vLLM's `return_token_ids` adds `prompt_token_ids` and each choice's `token_ids`. A
completion with `echo` streams its prompt as the first chunk (deployments.ingress.openai.echo).
"""

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deployments.chat_format.reply_parser import ReplyParser
from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.generation import Generation
from deployments.ingress.http.sse import sse_done, sse_error, sse_event
from deployments.ingress.openai.chat_reply import ChatReply
from deployments.ingress.openai.echo import EchoedPrompt
from deployments.ingress.openai.logprobs import LogprobFramer, whole_reply
from deployments.ingress.openai.prompt_logprobs import PromptLogprobs, rows_of
from deployments.ingress.usage import ReplySummary
from deployments.messages.render import ReplyFormat
from deployments.messages.replies import EngineChunk


@dataclass
class ReplyMeta:
    """What every body of one reply repeats."""

    request_id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    return_token_ids: bool = False
    include_usage: bool = False


class _Framer(abc.ABC):
    """Shared chunk plumbing; subclasses say where text goes and what the objects are called."""

    chunk_object = ""
    response_object = ""

    def __init__(self, meta: ReplyMeta, logprobs: LogprobFramer | None = None) -> None:
        self.meta = meta
        self.logprobs = logprobs  # when the request asked for logprobs

    # ---- per API ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _delta_choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _final_choice(self, text: str, finish: str, token_ids: list[int]) -> dict[str, Any]: ...

    def _prompt_ids_at_top(self) -> bool:
        return True

    # ---- chunks -----------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        meta = self.meta
        body: dict[str, Any] = {
            "id": meta.request_id,
            "object": self.chunk_object,
            "created": meta.created,
            "model": meta.model,
            "choices": choices,
        }
        if meta.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        """Events sent as soon as the request is accepted (before or with its first token)."""
        return []

    async def lead(self, chunk: EngineChunk) -> list[dict[str, Any]]:
        """Events that go before this engine chunk's own (an echoed prompt, ahead of the first chunk's)."""
        return []

    def deltas(self, text: str, token_ids: list[int]) -> list[dict[str, Any]]:
        """The events one engine chunk produces (none when it shows nothing new)."""
        if text or (self.meta.return_token_ids and token_ids):
            return [self.delta(text, token_ids)]
        return []

    def closing(self, finish: str, summary: ReplySummary) -> list[dict[str, Any]]:
        """The finish event (and, with include_usage, the usage event)."""
        events = [self.finish(finish, summary)]
        if self.meta.include_usage:
            events.append(self.usage_only(summary))
        return events

    def delta(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        choice = self._delta_choice(text, None)
        if self.meta.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._chunk([choice])

    def finish(self, finish: str, summary: ReplySummary) -> dict[str, Any]:
        choice = self._delta_choice(None, finish)
        if self.meta.return_token_ids:
            choice["token_ids"] = []
        body = self._chunk([choice])
        if not self.meta.include_usage:
            body["usage"] = summary.usage()
            body["tensorfold"] = summary.runtime_block()
        return body

    def usage_only(self, summary: ReplySummary) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = summary.usage()
        body["tensorfold"] = summary.runtime_block()
        return body

    async def complete(self, choice: dict[str, Any], chunks: list[EngineChunk]) -> None:
        """A whole reply's choice completed with what the chunks carried besides text (logprob rows)."""
        if self.logprobs is not None:
            choice["logprobs"] = await whole_reply(self.logprobs, chunks)

    def response(self, text: str, finish: str, summary: ReplySummary) -> dict[str, Any]:
        meta = self.meta
        choice = self._final_choice(text, finish, summary.token_ids)
        body: dict[str, Any] = {
            "id": meta.request_id,
            "object": self.response_object,
            "created": meta.created,
            "model": meta.model,
            "choices": [choice],
        }
        if meta.return_token_ids and self._prompt_ids_at_top():
            body["prompt_token_ids"] = list(meta.prompt_token_ids)
        body["usage"] = summary.usage()
        body["tensorfold"] = summary.runtime_block()
        return body


class ChatFramer(_Framer):
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, meta: ReplyMeta, reply: ChatReply | None = None, logprobs: LogprobFramer | None = None) -> None:
        super().__init__(meta, logprobs)
        # Splits reasoning, content and tool calls (deployments.ingress.openai.chat_reply); default: plain text.
        self.reply = reply if reply is not None else ChatReply(ReplyParser(ReplyFormat()))

    def _event(self, delta: dict[str, Any], token_ids: list[int] | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return self._chunk([choice])

    def deltas(self, text: str, token_ids: list[int]) -> list[dict[str, Any]]:
        parts = self.reply.feed(text)
        ids = list(token_ids) if self.meta.return_token_ids else None
        if not parts:
            return [self._event({}, ids)] if ids else []
        # The chunk's ids ride on its first event; later events of the same chunk carry an empty list.
        later = None if ids is None else []
        return [self._event(part, ids if i == 0 else later) for i, part in enumerate(parts)]

    def closing(self, finish: str, summary: ReplySummary) -> list[dict[str, Any]]:
        ids = [] if self.meta.return_token_ids else None
        held = [self._event(part, ids) for part in self.reply.flush(finish, summary.token_ids)]
        return held + super().closing(self.reply.finish_reason(finish), summary)

    def _delta_choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _final_choice(self, text: str, finish: str, token_ids: list[int]) -> dict[str, Any]:
        message = self.reply.message(text, finish, token_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": self.reply.finish_reason(finish),
        }
        if self.meta.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def opening(self) -> list[dict[str, Any]]:
        choice = self._delta_choice("", None, role=True)
        body = self._chunk([choice])
        if self.meta.return_token_ids:
            body["prompt_token_ids"] = list(self.meta.prompt_token_ids)
        return [body]


class CompletionFramer(_Framer):
    chunk_object = "text_completion"
    response_object = "text_completion"

    def _delta_choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def _final_choice(self, text: str, finish: str, token_ids: list[int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.meta.return_token_ids:  # vLLM puts both lists on the completion choice
            choice["prompt_token_ids"] = list(self.meta.prompt_token_ids)
            choice["token_ids"] = list(token_ids)
        return choice

    def __init__(
        self,
        meta: ReplyMeta,
        logprobs: LogprobFramer | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
        echo: EchoedPrompt | None = None,
    ) -> None:
        super().__init__(meta, logprobs)
        self.prompt_logprobs = prompt_logprobs  # when the request asked for prompt_logprobs
        self.echo = echo  # when the request asked for echo
        self._sent_prompt_ids = False  # a stream carries the prompt ids once, on its first text chunk
        self._echoed = False

    async def lead(self, chunk: EngineChunk) -> list[dict[str, Any]]:
        if self.echo is None or self._echoed:
            return []
        self._echoed = True
        event = self.delta(self.echo.text, [])
        if self.echo.top is not None:  # the prompt's rows come with the first chunk after the prompt pass
            event["choices"][0]["logprobs"] = await self.echo.legacy(chunk.prompt_logprobs or [])
        return [event]

    def _prompt_ids_at_top(self) -> bool:
        return False

    async def complete(self, choice: dict[str, Any], chunks: list[EngineChunk]) -> None:
        await super().complete(choice, chunks)
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = await self.prompt_logprobs.framed(rows_of(chunks))
        if self.echo is not None:
            await self.echo.prepend(choice, rows_of(chunks))

    def delta(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        body = super().delta(text, token_ids)
        if self.meta.return_token_ids and not self._sent_prompt_ids:
            body["choices"][0]["prompt_token_ids"] = list(self.meta.prompt_token_ids)
            self._sent_prompt_ids = True
        return body


async def stream_body(generation: Generation, framer: _Framer) -> AsyncIterator[bytes]:
    """The SSE bytes of one streamed reply; a failure after the stream opened becomes an error event.

    Each upstream chunk's events (and, after the last, `[DONE]`) leave as one write: every write crosses
    the middleware stack and a socket send, and a chunk already carries every token ready since the last."""
    done = False
    try:
        opening = b"".join(sse_event(event) for event in framer.opening())
        if opening:
            yield opening
        async for chunk in generation.chunks():
            lead = await framer.lead(chunk)  # before the chunk's own events, which the reply's rows attach to
            events = framer.deltas(chunk.text, chunk.token_ids)
            if chunk.finished:
                assert generation.summary is not None and generation.finish_reason is not None
                events += framer.closing(generation.finish_reason, generation.summary)
            if framer.logprobs is not None:  # rows ride with the event whose text completes them
                await framer.logprobs.attach(chunk, events)
            payload = b"".join(sse_event(event) for event in lead + events)
            done = chunk.finished
            if done:
                payload += sse_done()
            if payload:
                yield payload
    except GenerationFailed as exc:
        yield sse_error(str(exc))
    finally:
        await generation.close()  # the client left before the reply settled: cancel it upstream
    if not done:
        yield sse_done()


async def json_body_of(generation: Generation, framer: _Framer) -> dict[str, Any]:
    """The whole reply as one JSON body (raises GenerationFailed for the route to answer 500)."""
    text, chunks = await generation.collect()
    assert generation.summary is not None and generation.finish_reason is not None
    body = framer.response(text, generation.finish_reason, generation.summary)
    await framer.complete(body["choices"][0], chunks)
    return body
