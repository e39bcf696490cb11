"""The Slide room's work, as the Slide deployment (and the local backend) serve it: a change (learn or delete)
as a stream of items, the graph, a graph clear (docs/slide.md).

A change's stream starts with its one refusal, or with `ChangeStarted` once every refusal is past and the
lock is held on every replica; its events follow, and the lock is released when the stream ends, however
it ends (closed or cancelled by a caller that left included).
"""

from collections.abc import AsyncIterator
from contextlib import aclosing

from deployments.config import SlideSettings
from deployments.messages.replies import Refusal
from deployments.messages.slide import SlideGraph
from deployments.messages.slide_changes import (
    ChangeStarted,
    ForgetFact,
    LearnFacts,
    LearnText,
    SlideChange,
    SlideEvent,
    SlideItem,
)
from deployments.slide.changes import Change, error_event, shielded
from deployments.slide.checks import learned_questions
from deployments.slide.context import SlideContext, SlideRefused, bad_request
from deployments.slide.engine import SlideEngine
from deployments.slide.extraction import extraction_prompt
from deployments.slide.forgetting import forget_events
from deployments.slide.learning import learn_events, learn_text_events, pending_facts
from deployments.slide.links import SlideLinks

Started = tuple[Change, AsyncIterator[SlideEvent]]  # a change holding the lock, and its events (not begun)


class SlideRoom:
    def __init__(self, links: SlideLinks, settings: SlideSettings) -> None:
        self.ctx = SlideContext(links, settings)
        self.engine = SlideEngine(links)

    async def change(self, request: SlideChange) -> AsyncIterator[SlideItem]:
        """The change's refusal alone; or ChangeStarted, its events, and the lock released at the end."""
        try:
            change, events = await self._start(request)
        except SlideRefused as exc:
            yield exc.refusal
            return
        try:  # from here on the lock is held: every way out of this generator releases it
            yield ChangeStarted()
            async with aclosing(events) as steps:
                async for event in steps:
                    yield event
        except Exception as exc:
            yield error_event(exc)
        finally:
            await shielded(self.engine.end(change.owner))

    async def graph(self) -> SlideGraph | Refusal:
        try:
            return await self.engine.graph()
        except SlideRefused as exc:
            return exc.refusal

    async def clear(self, owner: str) -> int | Refusal:
        """Every fact removed from the graph (under the lock: not while a change runs); the weights keep theirs."""
        try:
            await self.engine.begin(owner, "a graph clear")
        except SlideRefused as exc:
            return exc.refusal
        try:
            return await self.engine.clear_graph()
        finally:
            await self.engine.end(owner)

    async def _start(self, request: SlideChange) -> Started:
        match request:
            case LearnFacts():
                return await self._learn_facts(request)
            case LearnText():
                return await self._learn_text(request)
            case ForgetFact():
                return await self._forget(request)
        raise TypeError(f"not a slide change: {type(request).__name__}")

    async def _learn_facts(self, request: LearnFacts) -> Started:
        """A learn of the facts given, once the pocket has room for them, their questions render within the
        window and the lock is held (400s, 503 first)."""
        change = Change(self.ctx, self.engine, request.owner, f"learn {request.owner}")
        graph = await self.engine.graph()
        if len(request.facts) > graph.room:
            message = (
                f"facts: the pocket has room for {graph.room} more facts, and this body gives {len(request.facts)}"
            )
            raise bad_request(message, "facts", "pocket_full")
        facts = await pending_facts(change, request.facts)
        change.learned = await learned_questions(self.ctx, graph.facts)
        await self.engine.begin(change.owner, change.what)
        return change, learn_events(change, facts)

    async def _learn_text(self, request: LearnText) -> Started:
        """A learn of a text's facts, once its extraction prompt fits the window and the lock is held."""
        change = Change(self.ctx, self.engine, request.owner, f"learn {request.owner}")
        graph = await self.engine.graph()
        prompt = await extraction_prompt(self.ctx, request.text)
        change.learned = await learned_questions(self.ctx, graph.facts)
        await self.engine.begin(change.owner, change.what)
        return change, learn_text_events(change, prompt, request.key_label)

    async def _forget(self, request: ForgetFact) -> Started:
        """A delete, once the fact is known and the lock is held (404, 503 first)."""
        wanted = request.fact_id
        change = Change(self.ctx, self.engine, request.owner, f"delete of fact {wanted}")
        graph = await self.engine.graph()
        fact = next((f for f in graph.facts if f.id == wanted), None)
        if fact is None:
            raise SlideRefused(Refusal(f"id: the graph holds no fact {wanted}", "id", "fact_not_found", status=404))
        change.learned = await learned_questions(self.ctx, graph.facts, leaving_out=wanted)
        await self.engine.begin(change.owner, change.what)
        return change, forget_events(change, fact, request.reason)
