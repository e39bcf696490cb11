"""POST /v1/decisions: SGLang's decision API, answered from next-token scores (deployments/ingress/decisions)."""

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from deployments.ingress.context import ServingContext
from deployments.ingress.decisions.framing import decisions_body
from deployments.ingress.decisions.models import DecisionRequest, parse_decisions
from deployments.ingress.decisions.serving import decide
from deployments.ingress.http.route import Arrival, json_route
from deployments.messages.requests import new_request_id

REQUEST_BODIES: dict[str, type[BaseModel]] = {"/v1/decisions": DecisionRequest}


def _decision_id(body: dict[str, Any] | None) -> str:
    return new_request_id("decision")


def decisions_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/decisions")
    @json_route(parse_decisions, _decision_id)
    async def decisions(fields: DecisionRequest, arrival: Arrival) -> Response:
        asked, scored = await decide(ctx, fields, arrival)
        return JSONResponse(decisions_body(ctx.settings.served_name, fields, arrival.request_id, asked, scored))

    return router
