"""What the Messages routes do: run a Messages request as its chat completion, or count its prompt.

Every failure answers in Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`, with the
error type Anthropic uses for the status, and a chat field an error names is named as the Messages field
the client sent; a failure after a stream opened is an `error` event.
"""

from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.anthropic.framing import MessagesFramer
from deployments.ingress.anthropic.models import CountTokensRequest, MessagesRequest
from deployments.ingress.anthropic.translate import messages_chat, prompt_request
from deployments.ingress.chat_run import counted_stream, render_chat_body, start_chat
from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import APIError, anthropic_response, refusal_error
from deployments.ingress.http.route import Arrival
from deployments.ingress.http.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from deployments.messages.window import reply_past_window

# Chat fields an error may name, as the Messages field the client sent.
_FIELDS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
    "thinking_budget": "thinking.budget_tokens",
}


def anthropic_error(exc: APIError) -> JSONResponse:
    message = exc.message
    for chat_name, name in _FIELDS.items():
        if message.startswith(chat_name):
            message = name + message[len(chat_name) :]
    return anthropic_response(exc.status, message)


async def run_messages(ctx: ServingContext, fields: MessagesRequest, arrival: Arrival) -> Response:
    run = await start_chat(ctx, messages_chat(fields), arrival.request_id, arrival.time, bool(fields.stream))
    framer = MessagesFramer(run, ctx.settings.served_name)
    if fields.stream:
        body = counted_stream(ctx, run.generation, framer.stream())
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    try:
        return JSONResponse(await framer.body())
    except GenerationFailed as exc:
        return anthropic_error(APIError(500, str(exc), "server_error"))


async def count_prompt(ctx: ServingContext, fields: CountTokensRequest) -> Response:
    """The token count of the prompt the body renders to; with max_tokens, refused where /v1/messages would be."""
    rendered = await render_chat_body(ctx, prompt_request(fields))
    count = len(rendered.prompt_token_ids)
    window = (await ctx.facts()).window
    too_long = reply_past_window(window, count, fields.max_tokens, "messages")  # as /v1/messages would refuse it
    if too_long is not None:
        raise refusal_error(too_long)
    return JSONResponse({"input_tokens": count})
