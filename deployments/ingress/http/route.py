"""The skeleton of every route that reads a JSON body: arrival, reply id, body, run, refusal, in one place;
and the request's API-key label, for per-key counts.

Arrival: stamp the wall clock (the request's `created` and its latency start) and note the caller's key
label for per-key metrics. The reply id is minted next (from the body, where its shape decides the id's
kind); the body is read as JSON, its `model` checked against the ids this server answers to (404
`model_not_found` otherwise, as OpenAI and vLLM answer; a body without one means the served model), and
it is parsed once into the route's typed model. Refusal: an APIError raised before the reply is sent is
logged as `refused <id>` and answered in the route's own error format. A route that only answers from its
body (counting, tokenizing) has no reply id and logs nothing: `json_query`. Auth puts the key's label
(never the key) on `request.state.key_label`; arrival copies it into a context variable, so the
EngineRequest built deeper in the same task carries it (`current_key_label`).
"""

import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments.ingress.http.errors import APIError, json_body
from deployments.ingress.http.finish_log import log_refused

Body = TypeVar("Body")
ErrorFormat = Callable[[APIError], JSONResponse]  # the route's own envelope (OpenAI's by default)
ReplyId = Callable[[dict[str, Any] | None], str]  # mints a reply id, given the body (None: it is not JSON)
Endpoint = Callable[[Request], Awaitable[Response]]
LoggedRun = Callable[[Body, "Arrival"], Awaitable[Response]]  # what a route does with its parsed body
QueryRun = Callable[[Body], Awaitable[Response]]


@dataclass(frozen=True)
class Arrival:
    """A request as its route received it."""

    time: float  # the wall clock at arrival: the reply's `created` and the start of its latency
    request_id: str  # the client-visible reply id (also the engine's) every outcome is logged under


def arrive(http: Request) -> float:
    arrival = time.time()
    capture_key_label(http)  # per-key request counts (metrics)
    return arrival


def served_body(http: Request, body: dict[str, Any]) -> dict[str, Any]:
    """`body` if it names a model this server answers to (or none); else the 404 OpenAI answers."""
    model = body.get("model")
    ids: list[str] = http.app.state.model_ids
    if isinstance(model, str) and model not in ids:
        served = ", ".join(f"`{i}`" for i in ids)
        message = f"The model `{model}` does not exist (this server answers to {served})."
        raise APIError(404, message, "invalid_request_error", "model", "model_not_found")
    return body  # a non-string model is the typed body's 400


def refusal(request_id: str, exc: APIError, respond: ErrorFormat = APIError.response) -> JSONResponse:
    log_refused(request_id, exc.status, exc.message)
    return respond(exc)


def _named(endpoint: Endpoint, run: Callable[..., Any]) -> Endpoint:
    endpoint.__name__, endpoint.__doc__ = run.__name__, run.__doc__  # the operation's id and description
    return endpoint


def json_route(
    read: Callable[[dict[str, Any]], Body], reply_id: ReplyId, errors: ErrorFormat = APIError.response
) -> Callable[[LoggedRun[Body]], Endpoint]:
    """`run(body, arrival)` as a FastAPI endpoint: `read` parses the JSON body into the route's typed model,
    and every APIError raised up to the reply is its refusal, logged and answered in `errors`' format."""

    def decorate(run: LoggedRun[Body]) -> Endpoint:
        async def endpoint(http: Request) -> Response:
            arrived = arrive(http)
            try:
                body = await json_body(http)
            except APIError as exc:
                return refusal(reply_id(None), exc, errors)
            arrival = Arrival(arrived, reply_id(body))
            try:
                return await run(read(served_body(http, body)), arrival)
            except APIError as exc:
                return refusal(arrival.request_id, exc, errors)

        return _named(endpoint, run)

    return decorate


def json_query(
    read: Callable[[dict[str, Any]], Body], errors: ErrorFormat = APIError.response
) -> Callable[[QueryRun[Body]], Endpoint]:
    """`run(body)` as a FastAPI endpoint for a route that answers from its body alone (counting, tokenizing):
    it has no reply id, so a refusal is answered in `errors`' format and not logged."""

    def decorate(run: QueryRun[Body]) -> Endpoint:
        async def endpoint(http: Request) -> Response:
            try:
                return await run(read(served_body(http, await json_body(http))))
            except APIError as exc:
                return errors(exc)

        return _named(endpoint, run)

    return decorate


NO_KEY = "none"
_key_label: ContextVar[str] = ContextVar("tensorfold_key_label", default=NO_KEY)


def capture_key_label(http: Request) -> None:
    label = getattr(http.state, "key_label", None)
    _key_label.set(label if isinstance(label, str) and label else NO_KEY)


def current_key_label() -> str:
    return _key_label.get()
