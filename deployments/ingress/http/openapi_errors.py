"""The error statuses each operation in /openapi.json can answer, with their bodies (docs/api.md, Errors).

FastAPI documents only the 200 its routes return; the refusals come from the middleware (401, 413), the
body reader (400, 404, 415) and the error handlers (405, 500), so they are added here, per operation, in the
envelope the route answers in: Anthropic's on `/v1/messages*`, OpenAI's elsewhere.
"""

from typing import Any

from deployments.ingress.http.limits import is_anthropic

OPENAI_ERROR = "ErrorResponse"
ANTHROPIC_ERROR = "AnthropicErrorResponse"
_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_SCHEMAS: dict[str, dict[str, Any]] = {
    OPENAI_ERROR: {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {**_NULLABLE_STRING, "description": "the request field the error concerns"},
                    "code": {**_NULLABLE_STRING, "description": "e.g. model_not_found, context_length_exceeded"},
                },
            }
        },
    },
    ANTHROPIC_ERROR: {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}
# Status -> what it means; which operations answer it is decided in `_statuses`.
_MEANINGS = {
    400: "malformed body or field (param names it), or a request past the context window",
    401: "no key, or a key this server does not accept",
    404: "the body names a model this server does not serve (code model_not_found), or the route is off",
    405: "the path called with a method it does not take; the Allow header lists those it takes",
    413: "the body is larger than max_body_bytes (code request_too_large)",
    415: "the body was not sent as JSON (code unsupported_media_type)",
    500: "an unexpected failure; the message carries no internal text",
    503: "the model is still loading past ready_wait_s, or no replica serves it",
}
_ALLOW = {"Allow": {"description": "the methods this path takes", "schema": {"type": "string"}}}


def _statuses(has_body: bool, keyed: bool) -> list[int]:
    statuses = [405, 500, 503]
    if keyed:
        statuses.append(401)
    if has_body:
        statuses.extend([400, 404, 413, 415])
    return sorted(statuses)


def _response(status: int, schema: str) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _MEANINGS[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
    if status == 405:
        response["headers"] = _ALLOW
    return response


def add_error_responses(spec: dict[str, Any], keys: bool, open_paths: tuple[str, ...]) -> None:
    """Document every operation's error statuses and bodies in `spec` (in place): the ones it can answer, not
    FastAPI's 422 (bodies are read by hand, and path parameters are strings); an open path needs no key."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_SCHEMAS)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, operations in spec.get("paths", {}).items():
        schema = ANTHROPIC_ERROR if is_anthropic(path) else OPENAI_ERROR
        keyed = keys and path not in open_paths
        for operation in operations.values():
            has_body = "requestBody" in operation
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _statuses(has_body, keyed):
                responses.setdefault(str(status), _response(status, schema))
            if keys and not keyed:
                operation["security"] = []  # the document's default asks every operation for a key
