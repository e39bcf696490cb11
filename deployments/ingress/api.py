"""The FastAPI app of an Ingress replica: every route over one ServingContext."""

from fastapi import FastAPI

from deployments.ingress.backend import Backend
from deployments.ingress.context import IngressSettings, ServingContext
from deployments.ingress.errors import install_error_handlers
from deployments.ingress.routes_generate import generate_router
from deployments.ingress.routes_info import info_router
from deployments.ingress.routes_tokenize import tokenize_router


def build_api(backend: Backend, settings: IngressSettings) -> FastAPI:
    ctx = ServingContext(backend, settings)
    app = FastAPI(title="TensorFold", version=settings.version, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(info_router(ctx))
    app.include_router(generate_router(ctx))
    app.include_router(tokenize_router(ctx))
    return app
