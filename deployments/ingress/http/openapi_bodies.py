"""The request bodies in /openapi.json, and the key schemes when keys are configured.

Routes read their bodies by hand (errors.py explains why), so FastAPI cannot see them; this fills each
documented path's requestBody from its pydantic model, so clients and fuzzers (the schemathesis test)
work from the real schema. A route family adds its paths to BODY_MODELS.
"""

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from deployments.ingress.anthropic.models import CountTokensRequest, MessagesRequest
from deployments.ingress.decisions.models import DecisionRequest
from deployments.ingress.openai import models as oa
from deployments.ingress.responses.models import ResponsesRequest

BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": oa.ChatCompletionRequest,
    "/v1/completions": oa.CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": oa.TokenizeRequest,
    "/v1/tokenize": oa.TokenizeRequest,
    "/detokenize": oa.DetokenizeRequest,
    "/v1/detokenize": oa.DetokenizeRequest,
    "/v1/decisions": DecisionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
_CHAT_MESSAGES = (oa.ChatCompletionRequest, oa.CompletionRequest, oa.TokenizeRequest)  # bodies whose `messages` are chat messages
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}  # fmt: skip
# What the routes accept as a message (openai_models._check_messages), which `list[dict]` leaves unsaid.
MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(oa.MESSAGE_ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
    },
}
_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def _with_bodies(spec: dict[str, Any], keys: bool) -> dict[str, Any]:
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODY_MODELS.items():
        operation = spec.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(mode="validation", ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        if model in _CHAT_MESSAGES:
            schema["properties"]["messages"] = {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}
        components[model.__name__] = schema
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        operation["requestBody"] = {"required": True, "content": content}
    if keys:
        spec["components"]["securitySchemes"] = _SCHEMES
        spec["security"] = [{"bearer": []}, {"apiKey": []}]
    return spec


def document_bodies(app: FastAPI, keys: bool) -> None:
    """Replace `app.openapi` with one that adds the bodies (built once, then cached like FastAPI's)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None or "x-bodies" not in app.openapi_schema:
            spec = _with_bodies(build(), keys)
            spec["x-bodies"] = True
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
