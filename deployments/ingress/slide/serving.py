"""What the /v1/slide routes ask the Slide room (deployments/slide/), and its answers in HTTP's terms.

A change is one streaming call: its first item is the room's refusal (answered in the route's format; a
busy lock's 503 carries Retry-After) or `ChangeStarted`, then its events, each named for the client. The
client leaving closes the call, which ends the change and releases its lock (the room does that).
"""

from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from deployments.engine_client.streams import ItemStream
from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import APIError, refusal_error
from deployments.ingress.slide.framing import NamedEvent, named
from deployments.messages.replies import Refusal
from deployments.messages.slide import SlideGraph
from deployments.messages.slide_changes import BUSY_CODE, ChangeStarted, SlideChange, SlideItem

RETRY_AFTER_S = 5  # a learn or a delete usually ends within seconds


class SlideBusy(APIError):
    """503: a learn or delete holds the lock (the reply carries Retry-After)."""

    def response(self) -> JSONResponse:
        reply = super().response()
        reply.headers["Retry-After"] = str(RETRY_AFTER_S)
        return reply


def slide_error(refusal: Refusal) -> APIError:
    """The room's refusal as the route's error."""
    if refusal.code == BUSY_CODE:
        return SlideBusy(refusal.status, refusal.message, refusal.type, refusal.param, refusal.code)
    return refusal_error(refusal)


async def start_change(ctx: ServingContext, change: SlideChange) -> AsyncIterator[NamedEvent]:
    """The change's events once the room has started it (its refusal raised first, before any event)."""
    await ctx.facts()  # a request sent while the model loads waits for it (503 past ready_wait_s)
    stream = ctx.backend.slide_change(change)
    items = stream.__aiter__()
    try:
        first = await anext(items)
    except BaseException:
        await stream.close()
        raise
    if isinstance(first, Refusal):
        raise slide_error(first)  # the room's stream ends with its refusal
    if not isinstance(first, ChangeStarted):
        await stream.close()
        raise RuntimeError(f"the Slide room began a change with {type(first).__name__}")
    return _named_events(stream, items)


async def _named_events(stream: ItemStream[SlideItem], items: AsyncIterator[SlideItem]) -> AsyncIterator[NamedEvent]:
    ended = False
    try:
        async for item in items:
            if isinstance(item, (Refusal, ChangeStarted)):
                raise RuntimeError(f"the Slide room sent {type(item).__name__} in a change's events")
            yield named(item)
        ended = True
    finally:
        if not ended:  # the client left (or the stream broke): the room ends the change and its lock
            await stream.close()


async def read_graph(ctx: ServingContext) -> SlideGraph:
    await ctx.facts()  # waits for the model while it loads (503 past ready_wait_s)
    graph = await ctx.backend.slide_graph()
    if isinstance(graph, Refusal):
        raise slide_error(graph)
    return graph


async def clear_graph(ctx: ServingContext, owner: str) -> int:
    """Every fact removed from the graph (not while a change runs); the weights keep theirs."""
    await ctx.facts()
    removed = await ctx.backend.slide_clear(owner)
    if isinstance(removed, Refusal):
        raise slide_error(removed)
    return removed
