"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's API on the one chat path."""

import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel

from deployments.ingress.anthropic.models import CountTokensRequest, MessagesRequest
from deployments.ingress.anthropic.serving import anthropic_error, count_prompt, run_messages
from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import parse_body
from deployments.ingress.http.route import Arrival, json_query, json_route
from deployments.ingress.http.sse import streamed_reply

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}


def _message_id(body: dict[str, Any] | None) -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def messages_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", responses=streamed_reply("a message, or its typed events"))
    @json_route(partial(parse_body, MessagesRequest), _message_id, anthropic_error)
    async def messages(fields: MessagesRequest, arrival: Arrival) -> Response:
        return await run_messages(ctx, fields, arrival)

    @router.post("/v1/messages/count_tokens")
    @json_query(partial(parse_body, CountTokensRequest), anthropic_error)
    async def count_tokens(fields: CountTokensRequest) -> Response:
        """The prompt the same body would run, counted without generating."""
        return await count_prompt(ctx, fields)

    return router
