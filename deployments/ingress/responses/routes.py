"""POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from deployments.ingress.context import ServingContext
from deployments.ingress.http.route import Arrival, json_route
from deployments.ingress.http.sse import streamed_reply
from deployments.ingress.responses.framing import new_id
from deployments.ingress.responses.models import ResponsesRequest, read_responses_body
from deployments.ingress.responses.serving import not_found, run_response

REQUEST_BODIES: dict[str, type[BaseModel]] = {"/v1/responses": ResponsesRequest}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_NOT_STORED: dict[int | str, Any] = {404: {"description": "no stored response has this id", "content": _ERROR}}


def _response_id(body: dict[str, Any] | None) -> str:
    return new_id("resp")


def responses_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", responses=streamed_reply("a response, or its typed events"))
    @json_route(read_responses_body, _response_id)
    async def create_response(fields: ResponsesRequest, arrival: Arrival) -> Response:
        return await run_response(ctx, fields, arrival)

    @router.get("/v1/responses/{response_id}", responses=_NOT_STORED)
    async def get_response(response_id: str) -> Response:
        stored = await ctx.backend.load_response(response_id)
        return not_found(response_id) if stored is None else JSONResponse(stored.response)

    @router.delete("/v1/responses/{response_id}", responses=_NOT_STORED)
    async def delete_response(response_id: str) -> Response:
        if not await ctx.backend.delete_response(response_id):
            return not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return router
