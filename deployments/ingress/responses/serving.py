"""What POST /v1/responses does: run the request as its chat completion, frame it, store it.

A request is refused (400, naming its Responses field) before any work; it then runs through the chat
handler as the equivalent chat completion. With `store` (the default) the finished response and its
conversation are saved before the body or the stream's last event is sent.
"""

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.chat_run import ChatRun, counted_stream, start_chat
from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import APIError, server_error
from deployments.ingress.http.route import Arrival
from deployments.ingress.http.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from deployments.ingress.responses.framing import ResponseEvents, ResponseHead, typed_event, whole_output
from deployments.ingress.responses.models import ResponsesRequest
from deployments.ingress.responses.translate import assistant_turn, responses_chat, responses_error
from deployments.messages.responses import StoredResponse


def _echo(fields: ResponsesRequest, run: ChatRun) -> dict[str, Any]:
    """The request's settings as a Response object repeats them (sampling as it ran)."""
    sampling = run.generation.request.sampling
    effort = (fields.reasoning or {}).get("effort")
    return {
        "instructions": fields.instructions,
        "tools": fields.tools or [],
        "tool_choice": fields.tool_choice if fields.tool_choice is not None else "auto",
        "parallel_tool_calls": fields.parallel_tool_calls is not False,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_output_tokens": fields.max_output_tokens,
        "previous_response_id": fields.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "text": {"format": (fields.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled",
        "store": fields.stores,
        "metadata": fields.metadata or {},
        "background": False,
    }


class _Exchange:
    """One request after validation: its started chat run, its framing head and what storing needs."""

    def __init__(
        self,
        ctx: ServingContext,
        fields: ResponsesRequest,
        run: ChatRun,
        head: ResponseHead,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.ctx, self.fields, self.run, self.head = ctx, fields, run, head
        self.conversation = conversation
        self.reader = run.reader()

    def status(self) -> str:
        return "incomplete" if self.run.generation.finish_reason == "length" else "completed"

    async def keep(self, body: dict[str, Any]) -> None:
        if self.fields.stores:
            messages = self.conversation + [assistant_turn(body["output"])]
            await self.ctx.backend.save_response(StoredResponse(body, messages))

    async def whole(self) -> Response:
        generation = self.run.generation
        try:
            text, _ = await generation.collect()
        except GenerationFailed as exc:
            return server_error(str(exc)).response()
        assert generation.summary is not None and generation.finish_reason is not None
        view = self.reader.whole(text, generation.finish_reason, generation.summary.token_ids)
        body = self.head.body(
            self.status(), whole_output(view, self.status() == "incomplete", self.head.namespaces), generation.summary
        )
        await self.keep(body)
        return JSONResponse(body)

    async def events(self) -> AsyncIterator[bytes]:
        generation = self.run.generation
        frames = ResponseEvents(self.head)
        try:
            for event in frames.opening():
                yield typed_event(event)
            async for chunk in generation.chunks():
                events = frames.feed(self.reader.read(chunk.text))
                if chunk.finished:
                    assert generation.summary is not None and generation.finish_reason is not None
                    summary = generation.summary
                    events += frames.feed(self.reader.read_end(generation.finish_reason, summary.token_ids))
                    events += frames.close_item("incomplete" if self.status() == "incomplete" else "completed")
                    body = self.head.body(self.status(), frames.output, generation.summary)
                    await self.keep(body)  # stored before the last event goes out
                    events.append(frames.finished(body))
                for event in events:
                    yield typed_event(event)
        except GenerationFailed as exc:
            for event in frames.failed(str(exc)):
                yield typed_event(event)
        finally:
            await generation.close()  # the client left before the reply settled: cancel it upstream


async def _history(ctx: ServingContext, fields: ResponsesRequest) -> list[dict[str, Any]]:
    if fields.previous_response_id is None:
        return []
    stored = await ctx.backend.load_response(fields.previous_response_id)
    if stored is None:
        raise APIError(
            400,
            f"previous_response_id: no stored response {fields.previous_response_id!r}",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored.messages


async def run_response(ctx: ServingContext, fields: ResponsesRequest, arrival: Arrival) -> Response:
    history = await _history(ctx, fields)
    try:  # a refusal naming a chat field names the Responses field it came from
        translated = responses_chat(fields, history, ctx.settings.drop_builtin_tools)
        run = await start_chat(ctx, translated.chat, arrival.request_id, arrival.time, bool(fields.stream))
    except APIError as exc:
        raise responses_error(exc) from None
    echo = _echo(fields, run)
    head = ResponseHead(arrival.request_id, int(arrival.time), ctx.settings.served_name, echo, translated.namespaces)
    exchange = _Exchange(ctx, fields, run, head, translated.conversation)
    if fields.stream:
        body = counted_stream(ctx, run.generation, exchange.events())
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    return await exchange.whole()


def not_found(response_id: str) -> JSONResponse:
    return APIError(404, f"no stored response {response_id!r}", "not_found_error", "response_id").response()
