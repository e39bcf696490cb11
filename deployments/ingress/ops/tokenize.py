"""vLLM's POST /tokenize and /detokenize (and their /v1 aliases).

/tokenize takes a prompt string (add_special_tokens, default true) or messages with the chat fields
(add_generation_prompt, default true) and returns the ids the chat route runs for the same messages.
"""

from typing import Any

from fastapi import APIRouter, Request

from deployments.ingress.context import ServingContext
from deployments.ingress.engine_request import check_token_ids
from deployments.ingress.http.errors import bad_request, json_body, parse_body, refusal_error
from deployments.ingress.http.limits import messages_over_window
from deployments.ingress.openai.models import DetokenizeRequest, TokenizeRequest, offered_tools
from deployments.ingress.tool_checks import CHAT, check_tools
from deployments.messages.render import ChatRenderRequest
from deployments.messages.replies import Refusal


async def _token_ids(ctx: ServingContext, fields: TokenizeRequest) -> list[int]:
    if fields.prompt is not None:
        add_special = fields.add_special_tokens is not False
        return await ctx.backend.tokenize(fields.prompt, add_special)
    too_many = await messages_over_window(fields.messages, ctx.facts)  # before rendering them
    if too_many:
        raise bad_request(too_many, "messages", "context_length_exceeded")
    render = ChatRenderRequest(
        messages=fields.messages or [],
        tools=offered_tools(fields.tools, fields.tool_choice),
        chat_template_kwargs=fields.chat_template_kwargs,
        add_generation_prompt=fields.add_generation_prompt is not False,
        reasoning_effort=fields.reasoning_effort,
    )
    rendered = await ctx.backend.render_chat(render)
    if isinstance(rendered, Refusal):
        raise refusal_error(rendered)
    return rendered.prompt_token_ids


def tokenize_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    async def tokenize(http: Request) -> dict[str, Any]:
        raw = await json_body(http)
        check_tools(raw.get("tools"), CHAT)  # the tools chat would render, checked as chat checks them
        fields = parse_body(TokenizeRequest, raw)
        ids = await _token_ids(ctx, fields)
        facts = await ctx.facts()
        body: dict[str, Any] = {"count": len(ids), "max_model_len": facts.window, "tokens": ids}
        if fields.return_token_strs:
            body["token_strs"] = await ctx.backend.token_strs(ids)
        return body

    async def detokenize(http: Request) -> dict[str, Any]:
        fields = parse_body(DetokenizeRequest, await json_body(http))
        check_token_ids(fields.tokens, await ctx.backend.card(), "tokens")
        return {"prompt": await ctx.backend.detokenize(fields.tokens)}

    for prefix in ("", "/v1"):
        router.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        router.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])
    return router
