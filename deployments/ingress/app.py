"""The FastAPI app of an Ingress replica: every route over one ServingContext."""

from fastapi import FastAPI

from deployments.ingress.anthropic.routes import messages_router
from deployments.ingress.backend import Backend
from deployments.ingress.context import IngressSettings, ServingContext
from deployments.ingress.decisions.routes import decisions_router
from deployments.ingress.http.auth import AuthMiddleware
from deployments.ingress.http.errors import install_error_handlers
from deployments.ingress.http.key_store import KeyStore
from deployments.ingress.http.limits import BodyLimitMiddleware
from deployments.ingress.http.openapi_bodies import document_bodies
from deployments.ingress.openai.routes import generate_router
from deployments.ingress.ops.dashboard import dashboard_router
from deployments.ingress.ops.imprint import imprint_router
from deployments.ingress.ops.info import info_router
from deployments.ingress.ops.memory import memory_router
from deployments.ingress.ops.metrics import metrics_router
from deployments.ingress.ops.tokenize import tokenize_router
from deployments.ingress.responses.routes import responses_router


def build_api(backend: Backend, settings: IngressSettings, keys: KeyStore | None = None) -> FastAPI:
    ctx = ServingContext(backend, settings)
    app = FastAPI(title="TensorFold", version=settings.version, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(info_router(ctx))
    app.include_router(generate_router(ctx))
    app.include_router(responses_router(ctx))
    app.include_router(messages_router(ctx))
    app.include_router(tokenize_router(ctx))
    app.include_router(decisions_router(ctx))
    app.include_router(imprint_router(ctx))
    app.include_router(metrics_router(ctx))
    app.include_router(memory_router(ctx))
    app.include_router(dashboard_router(ctx))
    document_bodies(app, keys=settings.auth.enabled)
    # The last added runs first: auth refuses before the body limit reads anything.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    store = keys if keys is not None else KeyStore(settings.auth)
    app.add_middleware(AuthMiddleware, store=store, metrics_open=settings.auth.metrics_open)
    return app
