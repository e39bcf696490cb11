"""OpenAI's error envelope, `{"error": {"message", "type", "param", "code"}}`, for every failure path.

Request bodies are parsed by hand (not by FastAPI's body binding) so a malformed field answers 400 in
this envelope, naming the field in `param`, instead of FastAPI's 422 format.
"""

import json
import logging
import sys
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.ingress.field_paths import FieldError, body_path, joined
from deployments.ingress.http.limits import MAX_JSON_DEPTH, is_anthropic, json_depth, lone_surrogate_path, route_path
from deployments.messages.replies import Refusal

log = logging.getLogger("tensorfold.ingress")
M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """An error answered in OpenAI's envelope with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


def refusal_error(refusal: Refusal) -> APIError:
    """A refusal (the engine's, the Renderer's or Ingress's own) as the route's error: its status, type,
    field and code as they are."""
    return APIError(refusal.status, refusal.message, refusal.type, refusal.param, refusal.code)


def from_validation_error(exc: ValidationError, body: Any = None) -> APIError:
    """The first problem pydantic found, with `param` the path to it in `body` as sent (a `FieldError`'s
    path below its field joined on): `tools[0].function.name`, `response_format.json_schema.schema`."""
    first = exc.errors(include_url=False)[0]
    path = body_path(body, first.get("loc", ()), missing=first.get("type") == "missing")
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, FieldError):
        param = joined(path, raised.below)
        return bad_request(f"{param}: {raised.why}" if param else raised.why, param or None)
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"{path} is required"
    if path and not message.startswith(path.split(".")[0].split("[")[0]):
        message = f"{path}: {message}"
    return bad_request(message, path or None)


def is_json_type(content_type: str | None) -> bool:
    """application/json or a `+json` type, any parameters (charset) aside."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def parsed_json(raw: bytes) -> Any:
    """`raw` as JSON, or a 400 saying why not: malformed, not UTF-8, nested past the limit, or holding an
    integer longer than Python reads from text (4,300 digits: json.loads raises ValueError for it)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        digits = sys.get_int_max_str_digits()
        raise bad_request(f"the request body holds an integer of more than {digits} digits") from None


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 415 (not sent as JSON) or 400 saying why not.

    A body sent as text/plain, a form or with no type is refused: those are what a web page may POST to
    another origin without asking first, so a keyless local server would run them (docs/api.md)."""
    if not is_json_type(request.headers.get("content-type")):
        sent = request.headers.get("content-type") or "no Content-Type"
        raise APIError(
            415,
            f"send the body as JSON with Content-Type: application/json (got {sent})",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
    raw = await request.body()
    body = parsed_json(raw)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if json_depth(body) > MAX_JSON_DEPTH:  # templates, schemas and grammars recurse over what we accept
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    surrogate_at = lone_surrogate_path(raw, body)
    if surrogate_at is not None:  # valid JSON, but not text any tokenizer can encode
        raise bad_request(f"{surrogate_at}: the string holds a lone UTF-16 surrogate", surrogate_at)
    return body


def parse_body(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc, body) from None


# Anthropic's error type for each status (any other status is an api_error).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_response(status: int, message: str) -> JSONResponse:
    """Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def _envelope(request: Request, status: int, message: str, type: str) -> JSONResponse:
    """OpenAI's envelope, or Anthropic's on the Messages routes."""
    if is_anthropic(route_path(request.scope)):
        return anthropic_response(status, message)
    return JSONResponse(error_body(message, type), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or a handler raises through the route's envelope."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if is_anthropic(route_path(request.scope)):
            return _envelope(request, exc.status, exc.message, exc.type)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = _envelope(request, exc.status_code, str(exc.detail), kind)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a route")
        return _envelope(request, 500, "internal server error (logged by the server)", "server_error")  # no internals
