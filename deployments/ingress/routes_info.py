"""GET /v1/models, GET /health and GET / (the same body)."""

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deployments.ingress.context import ServingContext
from deployments.ingress.errors import error_body
from deployments.ingress.health import health_body


def info_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    started = int(time.time())

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": model_id, "object": "model", "created": started, "owned_by": "tensorfold"}
                for model_id in ctx.settings.model_ids]  # fmt: skip
        return {"object": "list", "data": data}

    async def health(request: Request) -> JSONResponse:
        if getattr(request.state, "health_minimal", False):  # keys configured: liveness only, no details
            return JSONResponse({"status": "ok"})
        if request.query_params.get("reset_peak") in ("1", "true"):
            await ctx.backend.memory(reset_peak=True)  # a new CUDA peak at the current active, every replica
        replicas = await ctx.backend.replicas()
        if not replicas:
            body = error_body("no Scheduler replica answered: the model is not serving", "server_error")
            return JSONResponse(body, status_code=503)
        return JSONResponse(health_body(ctx.settings, replicas))

    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/", health, methods=["GET"])
    return router
