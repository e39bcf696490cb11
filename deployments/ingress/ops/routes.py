"""The operators' routes: GET /v1/models, /health and / (the same body), /memory, /metrics, /dashboard and
/stats; POST /tokenize and /detokenize (and their /v1 aliases); the imprint routes.

While the model loads (no Scheduler replica has answered yet), /health answers 503 with status "loading"
and /v1/models lists no model, so a client that waits for either can send its first request once they say
so. Afterwards /health answers 503 whenever no Scheduler replica's engine can take a request ("unavailable",
with the reason) and while the replica drains for a planned stop ("draining"). The bodies are built beside their topic: health.py, memory.py, metrics.py, dashboard.py, serving.py.
"""

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.context import ServingContext
from deployments.ingress.http.drain import RETRY_AFTER_S, SHUTTING_DOWN
from deployments.ingress.http.errors import error_body, json_body, parse_body
from deployments.ingress.http.route import json_query, served_body
from deployments.ingress.ops.dashboard import install_quiet_poll_filter, stats_snapshot
from deployments.ingress.ops.dashboard_page import DASHBOARD_HTML
from deployments.ingress.ops.health import health_body, loading_body
from deployments.ingress.ops.memory import memory_body
from deployments.ingress.ops.metrics import exposition
from deployments.ingress.ops.models import DetokenizeRequest, TokenizeRequest, read_imprint_body, read_tokenize_body
from deployments.ingress.ops.serving import detokenize_body, forget_body, imprint_body, require_store, tokenize_body

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/imprint/resume": ChatCompletionRequest,  # the chat completion the query is about
    "/v1/imprint/load": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/v1/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/detokenize": DetokenizeRequest,
}


def _at_both(router: APIRouter, path: str, endpoint: Callable[..., Any], **options: Any) -> None:
    """A GET route at `path` and at its /v1 alias."""
    for prefix in ("", "/v1"):
        router.add_api_route(prefix + path, endpoint, methods=["GET"], **options)


_STATUS = {  # /health's body when it cannot serve: why, in its own shape (not the error envelope)
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"enum": ["loading", "unavailable", "draining"]}, "message": {"type": "string"}},
}
_HEALTH: dict[int | str, Any] = {
    200: {
        "description": "ready: the live figures (with keys configured, only the status)",
        "content": {"application/json": {"schema": {"type": "object", "required": ["status"]}}},
    },
    503: {"description": "loading, unavailable or draining", "content": {"application/json": {"schema": _STATUS}}},
}


_STORE_OFF: dict[int | str, Any] = {
    404: {
        "description": "saved conversations are off (--learn-conversations)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
}


def _not_serving() -> JSONResponse:
    body = error_body("no Scheduler replica answered: the model is not serving", "server_error")
    return JSONResponse(body, status_code=503)


def _unavailable(status: str, reason: str, retry_after_s: int | None = None) -> JSONResponse:
    """/health's 503 once the model has loaded: why nothing can be served now (the keyed body too)."""
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return JSONResponse({"status": status, "message": reason}, status_code=503, headers=headers)


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
        if ctx.drain.draining:  # a planned stop: a load balancer should send nothing more here
            return _unavailable("draining", SHUTTING_DOWN, RETRY_AFTER_S)
        if request.query_params.get("reset_peak") in ("1", "true") and not minimal:
            await ctx.backend.memory(reset_peak=True)  # a new CUDA peak at the current active, every replica
        replicas = await readiness.probe()
        if not replicas and not readiness.ready:
            return JSONResponse(loading_body(ctx.settings, minimal), status_code=503)
        if not replicas:
            return _unavailable("unavailable", "no Scheduler replica answered: the model is not serving")
        if not any(r.serving for r in replicas):  # e.g. an engine process died; Serve is replacing it
            return _unavailable("unavailable", f"the model is not serving: {replicas[0].unavailable}")
        if minimal:
            return JSONResponse({"status": "ok"})
        return JSONResponse(health_body(ctx.settings, replicas, (await ctx.backend.card()).vision))

    for path in ("/health", "/"):
        router.add_api_route(path, health, methods=["GET"], responses=_HEALTH)
        router.add_api_route(path, health, methods=["HEAD"], include_in_schema=False)  # clients probing the server
    return router


def tokenize_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @json_query(read_tokenize_body)
    async def tokenize(fields: TokenizeRequest) -> Response:
        return JSONResponse(await tokenize_body(ctx, fields))

    @json_query(partial(parse_body, DetokenizeRequest))
    async def detokenize(fields: DetokenizeRequest) -> Response:
        return JSONResponse(await detokenize_body(ctx, fields))

    for prefix in ("", "/v1"):  # documented as answering a JSON object
        router.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"], response_model=dict[str, Any])
        router.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"], response_model=dict[str, Any])
    return router


def imprint_router(ctx: ServingContext) -> APIRouter:
    """Each answers 404 while saved conversations are off, before reading the body."""
    router = APIRouter()

    async def answer(http: Request, load: bool) -> dict[str, Any]:
        require_store(ctx)
        fields = read_imprint_body(served_body(http, await json_body(http)))
        return await imprint_body(ctx, fields, load)

    async def resume(http: Request) -> dict[str, Any]:
        return await answer(http, load=False)

    async def load(http: Request) -> dict[str, Any]:
        return await answer(http, load=True)

    async def forget() -> dict[str, Any]:
        return await forget_body(ctx)

    router.add_api_route("/v1/imprint/resume", resume, methods=["POST"])
    router.add_api_route("/v1/imprint/load", load, methods=["POST"])
    router.add_api_route("/v1/imprint", forget, methods=["DELETE"], responses=_STORE_OFF)
    return router


def metrics_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    async def metrics() -> Response:
        replicas = await ctx.backend.replicas()
        if not replicas:
            return _not_serving()
        return Response(exposition(ctx.settings.served_name, replicas), media_type=CONTENT_TYPE_LATEST)

    _at_both(router, "/metrics", metrics, include_in_schema=False)
    return router


def memory_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    async def memory() -> JSONResponse:
        replicas = await ctx.backend.memory()
        if not replicas:
            return _not_serving()
        return JSONResponse(memory_body(ctx.settings.served_name, replicas))

    _at_both(router, "/memory", memory)
    return router


def _dashboard_off() -> JSONResponse:
    body = error_body("the dashboard is off: start the server with --dashboard", "not_found_error")
    return JSONResponse(body, status_code=404)


def dashboard_router(ctx: ServingContext) -> APIRouter:
    """`--dashboard`: the page and the snapshot it polls; both answer 404 when the flag is off."""
    router = APIRouter()
    if ctx.settings.dashboard:
        install_quiet_poll_filter()

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        if not ctx.settings.dashboard:
            return _dashboard_off()
        return HTMLResponse(DASHBOARD_HTML, headers={"Cache-Control": "no-store"})

    @router.get("/stats", include_in_schema=False)
    async def stats() -> Response:
        if not ctx.settings.dashboard:
            return _dashboard_off()
        replicas = await ctx.backend.replicas()
        if not replicas:
            return _not_serving()
        return JSONResponse(stats_snapshot(ctx.settings.served_name, replicas), headers={"Cache-Control": "no-store"})

    return router
