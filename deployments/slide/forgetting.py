"""A delete as events (docs/slide.md, Deleting a fact): the fact marked `deleting`, its neurons zeroed in a
new version committed on every replica with the fact `deleted`, every other learned fact asked again at
that version, and the graph read back."""

from collections.abc import AsyncIterator

from deployments.messages.slide import SlideFact
from deployments.messages.slide_changes import (
    CheckedEvent,
    CheckingEvent,
    FactEvent,
    ForgotEvent,
    SlideEvent,
    ZeroedEvent,
)
from deployments.slide.asking import ask_all
from deployments.slide.changes import Change
from deployments.slide.checks import Kept, kept_facts


async def forget_events(change: Change, fact: SlideFact, reason: str | None) -> AsyncIterator[SlideEvent]:
    """fact, checking, zeroed, checked, forgot (a fact deleted already, or never learned: fact, forgot)."""
    yield FactEvent(fact)
    if fact.state == "deleted":  # idempotent: its neurons are zero and the graph says so
        yield ForgotEvent(fact.id, True, "deleted", fact.version)
        return
    if fact.state == "failed":  # never in the weights (its version was dropped); its neurons may be another's now
        marked = await change.engine.set_state(fact.id, "deleted", reason)
        state = marked.state if marked is not None else "missing"
        yield ForgotEvent(fact.id, state == "deleted", state, fact.version)
        return
    await change.engine.set_state(fact.id, "deleting", reason)
    yield CheckingEvent(fact.id, "deleting", len({q.fact_id for q in change.learned}))
    patch = await change.engine.zero(fact.id, await change.engine.trainer())
    version = await change.engine.stage(patch)
    saved = await change.engine.commit(version, fact.id, "deleted", reason)
    yield ZeroedEvent(fact.id, version, list(patch.neurons), saved)
    kept = await kept_after(change, version)
    yield CheckedEvent(fact.id, version, kept.facts, kept.kept, kept.changed)
    state = next((f.state for f in (await change.engine.graph()).facts if f.id == fact.id), "missing")
    yield ForgotEvent(fact.id, saved and state == "deleted", state, version)


async def kept_after(change: Change, version: int) -> Kept:
    replies = await ask_all(change.ctx, [(q.prompt, q.reply_limit) for q in change.learned], version)
    return kept_facts(change.learned, replies)
