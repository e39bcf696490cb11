"""The FastAPI app of an Ingress replica: every family's routes over one ServingContext, the request bodies
/openapi.json documents, the error envelopes, and the middleware (the drain, auth, then the body limit)."""

from fastapi import FastAPI
from pydantic import BaseModel

from deployments.ingress.anthropic import routes as anthropic
from deployments.ingress.backend import Backend
from deployments.ingress.context import IngressSettings, ServingContext
from deployments.ingress.decisions import routes as decisions
from deployments.ingress.http.auth import HEALTH_PATHS, METRICS_PATHS, AuthMiddleware
from deployments.ingress.http.drain import Drain, DrainMiddleware
from deployments.ingress.http.errors import install_error_handlers
from deployments.ingress.http.key_store import KeyStore
from deployments.ingress.http.limits import BodyLimitMiddleware
from deployments.ingress.http.openapi_bodies import document_bodies
from deployments.ingress.openai import routes as openai
from deployments.ingress.ops import routes as ops
from deployments.ingress.responses import routes as responses
from deployments.ingress.slide import routes as slide

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    **openai.REQUEST_BODIES,
    **responses.REQUEST_BODIES,
    **ops.REQUEST_BODIES,
    **decisions.REQUEST_BODIES,
    **anthropic.REQUEST_BODIES,
    **slide.REQUEST_BODIES,
}


def build_api(
    backend: Backend, settings: IngressSettings, keys: KeyStore | None = None, drain: Drain | None = None
) -> FastAPI:
    ctx = ServingContext(backend, settings, drain)
    app = FastAPI(title="TensorFold", version=settings.version, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.model_ids = list(settings.model_ids)  # what a body's `model` may name (deployments/ingress/http/route.py)
    app.include_router(ops.info_router(ctx))
    app.include_router(openai.generate_router(ctx))
    app.include_router(responses.responses_router(ctx))
    app.include_router(anthropic.messages_router(ctx))
    app.include_router(ops.tokenize_router(ctx))
    app.include_router(decisions.decisions_router(ctx))
    app.include_router(ops.imprint_router(ctx))
    app.include_router(slide.slide_router(ctx))
    app.include_router(ops.metrics_router(ctx))
    app.include_router(ops.memory_router(ctx))
    app.include_router(ops.dashboard_router(ctx))
    open_paths = HEALTH_PATHS + (METRICS_PATHS if settings.auth.metrics_open else ())
    document_bodies(app, REQUEST_BODIES, settings.auth.enabled, settings.model_ids, open_paths)
    # The last added runs first: auth refuses before the body limit reads anything.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    store = keys if keys is not None else KeyStore(settings.auth)
    app.add_middleware(AuthMiddleware, store=store, metrics_open=settings.auth.metrics_open)
    app.add_middleware(DrainMiddleware, drain=ctx.drain)  # outermost: it counts every request in flight
    return app
