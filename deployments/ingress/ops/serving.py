"""What the ops routes that take a body do: tokenize and detokenize, and the imprint queries.

/tokenize takes a prompt string (add_special_tokens, default true) or messages with the chat fields
(add_generation_prompt, default true) and returns the ids the chat route runs for the same messages.
The imprint routes take a chat completion's body, render it as that request would be rendered, and ask
the replica the request would be routed to, between its engine rounds:
  POST /v1/imprint/resume   where the next request would resume from, and the estimated wait
  POST /v1/imprint/load     read the conversation's disk state into RAM now, then answer as resume does
  DELETE /v1/imprint        forget every conversation state this model and build keep on disk
Without learn_conversations each answers 404 with OFF_MESSAGE.
"""

from dataclasses import asdict
from typing import Any

from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.chat_run import render_chat_body, tokenize_prompt
from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import check_token_ids
from deployments.ingress.http.errors import APIError, refusal_error
from deployments.ingress.ops.models import DetokenizeRequest, TokenizeRequest
from deployments.messages.render import RenderedPrompt
from deployments.messages.requests import ImprintQuery
from deployments.messages.store import StoreUnavailable
from deployments.messages.window import tokens_past_window

OFF_MESSAGE = "saved conversations are off: start the server with --learn-conversations"


async def tokenize_body(ctx: ServingContext, fields: TokenizeRequest) -> dict[str, Any]:
    if fields.prompt is not None:
        ids = await tokenize_prompt(ctx, fields.prompt, fields.add_special_tokens is not False)
    else:
        ids = (await render_chat_body(ctx, fields)).prompt_token_ids
    facts = await ctx.facts()
    body: dict[str, Any] = {"count": len(ids), "max_model_len": facts.window, "tokens": ids}
    if fields.return_token_strs:
        body["token_strs"] = await ctx.backend.token_strs(ids)
    return body


async def detokenize_body(ctx: ServingContext, fields: DetokenizeRequest) -> dict[str, Any]:
    check_token_ids(fields.tokens, await ctx.backend.card(), "tokens")
    return {"prompt": await ctx.backend.detokenize(fields.tokens)}


def require_store(ctx: ServingContext) -> None:
    if not ctx.settings.learn_conversations:
        raise APIError(404, OFF_MESSAGE, "not_found_error")


async def _rendered(ctx: ServingContext, fields: ChatCompletionRequest) -> RenderedPrompt:
    """The body's prompt, refused as its chat completion would be (the query is about that request)."""
    rendered = await render_chat_body(ctx, fields)
    ids = rendered.prompt_token_ids
    window = (await ctx.facts()).window  # a query sent while the model loads waits, as a chat request does
    too_long = tokens_past_window(window, len(ids), fields.reply_limit, "messages")
    if too_long is not None:
        raise refusal_error(too_long)
    return rendered


async def imprint_body(ctx: ServingContext, fields: ChatCompletionRequest, load: bool) -> dict[str, Any]:
    """Where the body's request would resume from (and, with `load`, its disk state read into RAM first)."""
    rendered = await _rendered(ctx, fields)  # its images name its blocks, as the engine names them
    reply = await ctx.backend.imprint(ImprintQuery(rendered.prompt_token_ids, load=load, images=rendered.images))
    body = asdict(reply)
    if not load:
        body.pop("loaded_tokens")
        body.pop("load_seconds")
    return body


async def forget_body(ctx: ServingContext) -> dict[str, Any]:
    """503 when a replica's store did not delete (its actor restarting): the client may try again."""
    require_store(ctx)
    await ctx.facts()
    freed = await ctx.backend.forget_disk()
    if isinstance(freed, StoreUnavailable):
        raise APIError(503, freed.message, "server_error")
    return {"freed_bytes": freed}
