"""POST /v1/chat/completions and POST /v1/completions.

Each request gets its reply id first, so every outcome can be logged under it: a 400 (malformed body,
template refusal, context refusal) logs `refused <id>`; the Generation logs `finished` or `ended`.
A /v1/completions body with messages is answered as chat, under a `chatcmpl-` id.
"""

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel

from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.context import ServingContext
from deployments.ingress.http.route import Arrival, json_route
from deployments.ingress.http.sse import streamed_reply
from deployments.ingress.openai.models import CompletionRequest, asks_for_chat, read_chat_body, read_completions_body
from deployments.ingress.openai.serving import run_chat, run_completion
from deployments.messages.requests import new_request_id

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def _chat_id(body: dict[str, Any] | None) -> str:
    return new_request_id("chatcmpl")


def _completions_id(body: dict[str, Any] | None) -> str:
    return new_request_id("chatcmpl" if asks_for_chat(body) else "cmpl")


def generate_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", responses=streamed_reply("a chat completion, or its chunks as events"))
    @json_route(read_chat_body, _chat_id)
    async def chat_completions(fields: ChatCompletionRequest, arrival: Arrival) -> Response:
        return await run_chat(ctx, fields, arrival)

    @router.post(
        "/v1/completions", responses=streamed_reply("a completion (a chat completion for messages), or its chunks")
    )
    @json_route(read_completions_body, _completions_id)
    async def completions(fields: ChatCompletionRequest | CompletionRequest, arrival: Arrival) -> Response:
        if isinstance(fields, ChatCompletionRequest):
            return await run_chat(ctx, fields, arrival)
        return await run_completion(ctx, fields, arrival)

    return router
