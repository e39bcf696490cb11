"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's API on the one chat path.

Every failure answers in Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`, with the
error type Anthropic uses for the status; a failure after a stream opened is an `error` event.
"""

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.ingress.anthropic.framing import MessagesFramer
from deployments.ingress.anthropic.models import CountTokensRequest, MessagesRequest
from deployments.ingress.anthropic.translate import chat_body, prompt_fields
from deployments.ingress.chat_run import render_chat_body, start_chat
from deployments.ingress.context import ServingContext
from deployments.ingress.generation import GenerationFailed
from deployments.ingress.http.errors import APIError, anthropic_response, json_body, parse_body, refusal_error
from deployments.ingress.http.route import arrive, refusal
from deployments.ingress.http.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from deployments.ingress.openai.models import ChatCompletionRequest
from deployments.messages.replies import Refusal

# Chat fields an error may name, as the Messages field the client sent.
_FIELDS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort", "thinking_budget": "thinking.budget_tokens"}  # fmt: skip


def anthropic_error(exc: APIError) -> JSONResponse:
    message = exc.message
    for chat_name, name in _FIELDS.items():
        if message.startswith(chat_name):
            message = name + message[len(chat_name) :]
    return anthropic_response(exc.status, message)


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def messages_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(http: Request) -> Response:
        arrival = arrive(http)
        request_id = _message_id()
        try:
            fields = parse_body(MessagesRequest, await json_body(http))
            run = await start_chat(ctx, chat_body(fields), request_id, arrival)
        except APIError as exc:
            return refusal(request_id, exc, anthropic_error)
        framer = MessagesFramer(run, ctx.settings.served_name)
        if fields.stream:
            return StreamingResponse(framer.stream(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
        try:
            return JSONResponse(await framer.body())
        except GenerationFailed as exc:
            return anthropic_error(APIError(500, str(exc), "server_error"))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(http: Request) -> Response:
        """The prompt the same body would run, counted without generating."""
        try:
            fields = parse_body(CountTokensRequest, await json_body(http))
            chat = parse_body(ChatCompletionRequest, {k: v for k, v in prompt_fields(fields).items() if v is not None})
            rendered = await render_chat_body(ctx, chat)
            count = len(rendered.prompt_token_ids)
            window = (await ctx.facts()).window
            if fields.max_tokens is not None and count + fields.max_tokens > window:  # as /v1/messages would refuse
                raise refusal_error(Refusal.context_length(window, count, fields.max_tokens, "messages"))
        except APIError as exc:
            return anthropic_error(exc)
        return JSONResponse({"input_tokens": count})

    return router
