"""The imprint routes: how much of a conversation resumes from the disk store, and from where.

Each takes a chat completion's body (messages, tools, chat_template_kwargs), renders it as that request
would be rendered, and asks the replica the request would be routed to, between its engine rounds:
  POST /v1/imprint/resume   where the next request would resume from, and the estimated wait
  POST /v1/imprint/load     read the conversation's disk state into RAM now, then answer as resume does
  DELETE /v1/imprint        forget every conversation state this model and build keep on disk
Without learn_conversations each answers 404 with the manual's message.
"""

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request

from deployments.ingress.chat_run import checked_body, render_chat_body
from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import APIError, json_body, parse_body, refusal_error
from deployments.ingress.openai.models import ChatCompletionRequest
from deployments.ingress.tool_checks import CHAT, check_tools
from deployments.messages.replies import Refusal
from deployments.messages.requests import ImprintQuery

OFF_MESSAGE = "saved conversations are off: start the server with --learn-conversations"


def imprint_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    def require_store() -> None:
        if not ctx.settings.learn_conversations:
            raise APIError(404, OFF_MESSAGE, "not_found_error")

    async def rendered_ids(http: Request) -> list[int]:
        """The body's prompt, refused as its chat completion would be (the query is about that request)."""
        raw = await json_body(http)
        checked_body(raw)
        check_tools(raw.get("tools"), CHAT)
        fields = parse_body(ChatCompletionRequest, raw)
        ids = (await render_chat_body(ctx, fields)).prompt_token_ids
        window = (await ctx.facts()).window  # a query sent while the model loads waits, as a chat request does
        requested = fields.reply_limit
        if len(ids) >= window or (requested is not None and len(ids) + requested > window):
            raise refusal_error(Refusal.context_length(window, len(ids), requested, "messages"))
        return ids

    async def answer(http: Request, load: bool) -> dict[str, Any]:
        require_store()
        ids = await rendered_ids(http)
        reply = await ctx.backend.imprint(ImprintQuery(ids, load=load))
        body = asdict(reply)
        if not load:
            body.pop("loaded_tokens")
            body.pop("load_seconds")
        return body

    async def resume(http: Request) -> dict[str, Any]:
        return await answer(http, load=False)

    async def load(http: Request) -> dict[str, Any]:
        return await answer(http, load=True)

    async def forget() -> dict[str, Any]:
        require_store()
        await ctx.facts()
        return {"freed_bytes": await ctx.backend.forget_disk()}

    router.add_api_route("/v1/imprint/resume", resume, methods=["POST"])
    router.add_api_route("/v1/imprint/load", load, methods=["POST"])
    router.add_api_route("/v1/imprint", forget, methods=["DELETE"])
    return router
