"""The /v1/slide bodies and events (docs/slide.md, Events): facts and the graph as JSON, each event the Slide
room streams as a named server-sent event (`event: <name>`, then `data:` its JSON, which also carries
`"type": <name>`), or all of a change's events in one JSON body when the request says `"stream": false`."""

import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from deployments.messages.slide import SlideFact, SlideGraph
from deployments.messages.slide_changes import FactEvent, SlideEvent


@dataclass
class NamedEvent:
    """One step of a learn or a delete, as the client sees it."""

    name: str  # fact, learning, learned, failed; fact, checking, zeroed, checked, forgot; error
    data: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {"type": self.name, **self.data}


def fact_json(fact: SlideFact) -> dict[str, Any]:
    return {
        "id": fact.id,
        "text": fact.text,
        "state": fact.state,
        "neurons": list(fact.neurons),
        "questions": [{"question": q.question, "answer": q.answer} for q in fact.questions],
        "version": fact.version,
        "reason": fact.reason,
        "created": fact.created,
        "updated": fact.updated,
    }


def graph_json(graph: SlideGraph) -> dict[str, Any]:
    return {
        "object": "slide.graph",
        "model": graph.model,
        "busy": graph.busy,
        "pocket": asdict(graph.pocket),
        "facts": [fact_json(fact) for fact in graph.facts],
    }


def named(event: SlideEvent) -> NamedEvent:
    """A room's event as the client reads it: its fields in order (a nested figure as an object), less those
    that default to None and are None (messages/slide_changes.py)."""
    if isinstance(event, FactEvent):
        return NamedEvent(event.name, fact_json(event.fact))
    data: dict[str, Any] = {}
    for item in fields(event):
        value = getattr(event, item.name)
        if value is None and item.default is None:
            continue
        data[item.name] = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
    return NamedEvent(event.name, data)


def sse_named(event: NamedEvent) -> bytes:
    data = json.dumps(event.body(), ensure_ascii=False, separators=(",", ":"))
    return f"event: {event.name}\ndata: {data}\n\n".encode()


async def sse_stream(events: AsyncIterator[NamedEvent]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield sse_named(event)
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # a client that left: the change ends its lock


async def events_body(kind: str, events: AsyncIterator[NamedEvent]) -> dict[str, Any]:
    """`"stream": false`: every event, in order, in one body."""
    return {"object": kind, "events": [event.body() async for event in events]}
