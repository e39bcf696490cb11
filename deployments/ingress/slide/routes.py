"""/v1/slide: living weights (docs/slide.md). POST /v1/slide/learn, GET and DELETE /v1/slide/graph, DELETE
/v1/slide/fact/{id}. A server without `--slide` answers all four 501 (and leaves them out of /openapi.json)."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import APIError, json_body
from deployments.ingress.http.route import Arrival, current_key_label, json_route, refusal
from deployments.ingress.http.sse import SSE_HEADERS, SSE_MEDIA_TYPE, streamed_reply
from deployments.ingress.slide.framing import NamedEvent, events_body, graph_json, sse_stream
from deployments.ingress.slide.models import ForgetRequest, LearnRequest, fact_id, parse_forget, parse_learn
from deployments.ingress.slide.serving import clear_graph, read_graph, start_change
from deployments.messages.requests import new_request_id
from deployments.messages.slide_changes import ForgetFact, LearnFacts, LearnText, SlideChange

REQUEST_BODIES: dict[str, type[BaseModel]] = {"/v1/slide/learn": LearnRequest, "/v1/slide/fact/{id}": ForgetRequest}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_RETRY = {"Retry-After": {"description": "seconds to wait before sending it again", "schema": {"type": "string"}}}
_OFF = {501: {"description": "the server was started without --slide (type not_implemented)", "content": _ERROR}}
_BUSY = {503: {"description": "a learn or delete is running (code slide_busy)", "content": _ERROR, "headers": _RETRY}}


def _events(kind: str, names: tuple[str, ...]) -> dict[int | str, Any]:
    """A change's 200 as /openapi.json documents it: each event named, its data a JSON object naming it again
    (docs/slide.md, Events), or with stream false one body holding them all."""
    data = {"type": "object", "required": ["type"], "properties": {"type": {"enum": list(names)}}}
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"enum": list(names)},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data},
        },
    }
    body = {
        "type": "object",
        "required": ["object", "events"],
        "properties": {"object": {"const": kind}, "events": {"type": "array", "items": data}},
    }
    what = "the change's events: named server-sent events, or with stream false one JSON body"
    return streamed_reply(what, event, body)


_LEARN_EVENTS = _events("slide.learn", ("fact", "learning", "learned", "failed", "error"))
_DELETE_EVENTS = _events("slide.delete", ("fact", "checking", "zeroed", "checked", "forgot", "error"))
_FACT_ERRORS = {
    400: {
        "description": "a malformed body, or an id that is not a positive whole number of at most 18 digits",
        "content": _ERROR,
    },
    404: {"description": "the graph holds no fact with this id (code fact_not_found)", "content": _ERROR},
}


def _respond(exc: APIError) -> JSONResponse:
    return exc.response()  # a 503 adds its Retry-After


def _answer(kind: str, events: AsyncIterator[NamedEvent], streamed: bool) -> Response:
    if streamed:
        return StreamingResponse(sse_stream(events), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    return _JSONEvents(kind, events)


class _JSONEvents(Response):
    """`"stream": false`: the change runs while the body is being sent, then answers every event at once."""

    media_type = "application/json"

    def __init__(self, kind: str, events: AsyncIterator[NamedEvent]) -> None:
        super().__init__()
        self._kind, self._events = kind, events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            reply = JSONResponse(await events_body(self._kind, self._events))
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
        await reply(scope, receive, send)


def _learn(fields: LearnRequest, owner: str) -> SlideChange:
    if fields.facts is not None:
        return LearnFacts(owner, list(fields.facts))
    return LearnText(owner, fields.text or "", current_key_label())


async def _optional_body(http: Request) -> dict[str, Any]:
    """A DELETE's body is optional: none (or an empty one) is `{}`."""
    if not await http.body():
        return {}
    return await json_body(http)


def slide_router(ctx: ServingContext) -> APIRouter:
    def slide_on() -> None:
        if not ctx.settings.slide:
            message = "living weights are off: start the server with --slide (YAML slide: true) to use /v1/slide"
            raise APIError(501, message, "not_implemented", None, "slide_off")

    router = APIRouter(dependencies=[Depends(slide_on)], include_in_schema=ctx.settings.slide)

    @router.post("/v1/slide/learn", responses={**_LEARN_EVENTS, **_OFF, **_BUSY})
    @json_route(parse_learn, lambda body: new_request_id("slidelearn"), _respond)
    async def slide_learn(fields: LearnRequest, arrival: Arrival) -> Response:
        """Learn the facts of a text, or the facts given: fact, learning, learned or failed events."""
        return _answer("slide.learn", await start_change(ctx, _learn(fields, arrival.request_id)), fields.streamed)

    @router.get("/v1/slide/graph", responses=_OFF)
    async def slide_graph() -> JSONResponse:
        """Every fact (state, neurons, questions and expected answers, reason) and the pocket."""
        return JSONResponse(graph_json(await read_graph(ctx)))

    @router.delete("/v1/slide/graph", responses={**_OFF, **_BUSY})
    async def slide_clear() -> JSONResponse:
        """Clear the graph; the weights keep what they learned."""
        try:
            removed = await clear_graph(ctx, new_request_id("slideclear"))
        except APIError as exc:
            return _respond(exc)
        return JSONResponse({"object": "slide.graph.cleared", "removed": removed})

    @router.delete("/v1/slide/fact/{id}", responses={**_DELETE_EVENTS, **_OFF, **_BUSY, **_FACT_ERRORS})
    async def slide_forget(id: str, http: Request) -> Response:
        """Delete one fact from the weights, checking every other: fact, checking, zeroed, checked, forgot."""
        request_id = new_request_id("slidedelete")
        try:
            fields = parse_forget(await _optional_body(http))
            forget = ForgetFact(request_id, fact_id(id), fields.reason)
            events = await start_change(ctx, forget)
        except APIError as exc:
            return refusal(request_id, exc, _respond)
        return _answer("slide.delete", events, fields.streamed)

    return router
