"""GET /v1/models, GET /health and GET / (the same body).

While the model loads (no Scheduler replica has answered yet), /health answers 503 with status "loading"
and /v1/models lists no model, so a client that waits for either can send its first request once they say so.
"""

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import error_body
from deployments.ingress.ops.health import health_body, loading_body


def info_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    started = int(time.time())
    readiness = ctx.readiness

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        if not readiness.ready:
            await readiness.probe()
        ids = ctx.settings.model_ids if readiness.ready else []  # listed once a request can be answered
        data = [{"id": model_id, "object": "model", "created": started, "owned_by": "tensorfold"} for model_id in ids]
        return {"object": "list", "data": data}

    async def health(request: Request) -> JSONResponse:
        minimal = getattr(request.state, "health_minimal", False)  # keys configured: liveness only, no details
        if minimal and readiness.ready:
            return JSONResponse({"status": "ok"})
        if request.query_params.get("reset_peak") in ("1", "true") and not minimal:
            await ctx.backend.memory(reset_peak=True)  # a new CUDA peak at the current active, every replica
        replicas = await readiness.probe()
        if not replicas and not readiness.ready:
            return JSONResponse(loading_body(ctx.settings, minimal), status_code=503)
        if not replicas:
            body = error_body("no Scheduler replica answered: the model is not serving", "server_error")
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"} if minimal else health_body(ctx.settings, replicas))

    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/", health, methods=["GET"])
    return router
