"""What the /v1/slide changes do, as events (docs/slide.md): a learn, fact by fact, and a delete.

Everything that can refuse a request (its body, the pocket's room, a question past the window, the lock)
is settled before the first event; from then on a fact that cannot be learned is a `failed` event, and an
unexpected failure an `error` event, never a broken server. The lock is released whatever happens.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from deployments.ingress.context import ServingContext
from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.slide.asking import ask_all
from deployments.ingress.slide.calls import SlideEngine
from deployments.ingress.slide.checks import (
    Kept,
    Locality,
    Question,
    fact_questions,
    judge,
    kept_facts,
    learned_questions,
    locality_baseline,
)
from deployments.ingress.slide.extraction import extract_facts, extraction_prompt_length
from deployments.ingress.slide.framing import SlideEvent, fact_json
from deployments.ingress.slide.locality import LOCALITY_REPLY_TOKENS
from deployments.ingress.slide.models import FactBody, ForgetRequest, LearnRequest, fact_id
from deployments.messages.slide import SlideFact, SlideGraph, SlideQuestion, TrainJob, TrainProgress

log = logging.getLogger("tensorfold.ingress")
TRAIN_SLICE_S = 0.25  # how often the Ingress asks the trainer for progress: a learning event at least this often
_BACKGROUND: set[asyncio.Task[None]] = set()  # strong references to clean-ups in flight


@dataclass
class Pending:
    """A fact to learn, its questions already rendered (their fact id is set once the graph adds it)."""

    body: FactBody
    questions: list[Question]


@dataclass
class Change:
    """A learn or delete that holds the lock: who holds it, and what every step needs."""

    ctx: ServingContext
    engine: SlideEngine
    owner: str  # the request id: the lock's owner
    what: str  # what GET /v1/slide/graph's `busy` and a refused change's 503 say is running
    learned: list[Question] = field(default_factory=list)  # every learned fact's questions (kept answering)


async def release(change: Change) -> None:
    """End the change's lock on every replica, even while its request is being cancelled."""
    await _shielded(change.engine.end(change.owner))


def error_event(exc: Exception) -> SlideEvent:
    if isinstance(exc, APIError):
        return SlideEvent("error", {"message": exc.message})
    log.error("a living-weights change failed", exc_info=exc)
    return SlideEvent(
        "error", {"message": "the change failed on the server (logged); GET /v1/slide/graph shows each fact"}
    )


async def guarded(change: Change, events: AsyncIterator[SlideEvent]) -> AsyncIterator[SlideEvent]:
    """`events`, then the lock released; a failure ends the stream with an `error` event."""
    try:
        async with aclosing(events) as steps:  # closed before the lock is released, whatever ended it
            async for event in steps:
                yield event
    except Exception as exc:
        yield error_event(exc)
    finally:
        await release(change)


# ---- learn ----


async def pending_facts(change: Change, bodies: list[FactBody], param: str = "facts") -> list[Pending]:
    return [
        Pending(body, await fact_questions(change.ctx, 0, _pairs(body), f"{param}[{i}]"))
        for i, body in enumerate(bodies)
    ]


def _pairs(body: FactBody) -> list[SlideQuestion]:
    return [SlideQuestion(q.question, q.answer) for q in body.questions]


async def learn_events(
    change: Change, facts: list[Pending] | None, text: str, prompt_tokens: int
) -> AsyncIterator[SlideEvent]:
    """Each fact's events in turn (the text's facts extracted first, when the body gave a text)."""
    if facts is None:
        extracted = await extract_facts(change.ctx, text, prompt_tokens)
        if extracted.reason is not None:
            yield SlideEvent("failed", {"id": None, "reason": f"no facts to learn: {extracted.reason}"})
            return
        try:
            facts = await pending_facts(change, extracted.facts, "extracted")
        except APIError as exc:
            yield SlideEvent("failed", {"id": None, "reason": f"the extracted facts cannot be asked: {exc.message}"})
            return
    baseline = await locality_baseline(change.ctx)
    trainer = await change.engine.trainer()
    for pending in facts:
        await change.engine.begin(change.owner, change.what)  # renews the lock's lease for this fact
        async with aclosing(learn_fact(change, pending, baseline, trainer)) as steps:
            async for event in steps:
                yield event


async def learn_fact(
    change: Change, pending: Pending, baseline: list[Locality], trainer: str
) -> AsyncIterator[SlideEvent]:
    """fact, learning..., then learned or failed; a learn stopped on the way leaves the fact failed."""
    started = time.monotonic()
    added = await change.engine.add_fact(pending.body.text, _pairs(pending.body))
    if isinstance(added, str):
        yield SlideEvent("failed", {"id": None, "text": pending.body.text, "reason": added})
        return
    for question in pending.questions:
        question.fact_id = added.id
    staged: list[int] = []  # the version staged for its checks, once it is
    settled = False
    try:
        yield SlideEvent("fact", fact_json(added))
        progress = TrainProgress()
        async for event in train(change, added, pending.questions, baseline, trainer, progress):
            yield event
        if progress.patch is None:
            settled = True
            yield await fail(change, added.id, progress.failed or "training ended without a fit", None)
            return
        staged.append(await change.engine.stage(progress.patch))
        event = await check_and_commit(change, added.id, staged[0], pending.questions, baseline)
        settled = True
        yield _timed(event, progress, started)
    finally:
        if not settled:
            await _shielded(_abandon(change, added.id, staged))


async def check_and_commit(
    change: Change, fact: int, version: int, questions: list[Question], baseline: list[Locality]
) -> SlideEvent:
    """Judge the staged version: commit it (learned) or drop it (failed)."""
    verdict = await judge(change.ctx, version, questions, change.learned, baseline)
    if verdict.reason is not None:
        await change.engine.drop(version)
        return await fail(change, fact, verdict.reason, {"version": version, "checked": verdict.figures()})
    saved = await change.engine.commit(version, fact, "learned", None)
    change.learned += questions
    return SlideEvent("learned", {"id": fact, "version": version, "saved": saved, "checked": verdict.figures()})


def _timed(event: SlideEvent, progress: TrainProgress, started: float) -> SlideEvent:
    if event.name == "learned":
        steps = progress.steps[-1][0] if progress.steps else 0
        event.data.update(steps=steps, seconds=round(time.monotonic() - started, 3))
    return event


async def _abandon(change: Change, fact: int, staged: list[int]) -> None:
    """A learn that stopped mid-fact (the client left, an engine call failed): its version dropped, the fact
    failed, so no neurons stay held by a fact nobody is learning."""
    try:
        for version in staged:
            await change.engine.drop(version)
        await change.engine.set_state(fact, "failed", "the learn stopped before its checks ended")
    except Exception:
        log.warning("could not settle fact %d after its learn stopped", fact, exc_info=True)


async def _shielded(work: Coroutine[Any, Any, None]) -> None:
    """`work` runs to its end even while the request that started it is being cancelled."""
    task = asyncio.get_running_loop().create_task(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    await asyncio.shield(task)


async def fail(change: Change, fact: int, reason: str, extra: dict[str, object] | None) -> SlideEvent:
    await change.engine.set_state(fact, "failed", reason)
    return SlideEvent("failed", {"id": fact, "reason": reason, **(extra or {})})


async def train(
    change: Change,
    fact: SlideFact,
    questions: list[Question],
    baseline: list[Locality],
    trainer: str,
    result: TrainProgress,
) -> AsyncIterator[SlideEvent]:
    """Train `fact` on the trainer replica slice by slice, one `learning` event per slice; `result` ends as
    the last slice's progress, with every step seen."""
    settings = change.ctx.settings
    # The other facts' questions stay quiet along the path the base model (version 0) answers them on, so a
    # deleted fact's question answers as before it was learned; their answers are kept.
    learned = change.learned
    base_replies = await ask_all(change.ctx, [(q.prompt, LOCALITY_REPLY_TOKENS) for q in learned], 0)
    quiet = [b.quiet for b in baseline] + [q.prompt.ids + r.token_ids for q, r in zip(learned, base_replies)]
    examples = [q.example for q in questions]
    job = TrainJob(
        fact.id, list(fact.neurons), examples, quiet, settings.slide_steps, settings.slide_margin,
        settings.slide_learning_rate, kept=[q.example for q in learned],
    )  # fmt: skip
    while not result.done:
        asked = time.monotonic()
        progress = await change.engine.train(job, trainer)
        if not progress.done:  # an engine that answers at once trains meanwhile: ask again after the slice
            await asyncio.sleep(max(0.0, TRAIN_SLICE_S - (time.monotonic() - asked)))
        result.steps += progress.steps
        result.answer_rows, result.done = progress.answer_rows, progress.done
        result.patch, result.failed = progress.patch, progress.failed
        if progress.steps:
            step, loss, right = progress.steps[-1]
            yield SlideEvent(
                "learning", {"id": fact.id, "step": step, "loss": loss, "right": right, "rows": progress.answer_rows}
            )


# ---- delete ----


async def forget_events(change: Change, fact: SlideFact, reason: str | None) -> AsyncIterator[SlideEvent]:
    """fact, checking, zeroed, checked, forgot (a fact deleted already, or never learned: fact, forgot)."""
    yield SlideEvent("fact", fact_json(fact))
    if fact.state == "deleted":  # idempotent: its neurons are zero and the graph says so
        yield SlideEvent("forgot", {"id": fact.id, "deleted": True, "state": "deleted", "version": fact.version})
        return
    if fact.state == "failed":  # never in the weights (its version was dropped); its neurons may be another's now
        marked = await change.engine.set_state(fact.id, "deleted", reason)
        state = marked.state if marked is not None else "missing"
        yield SlideEvent(
            "forgot", {"id": fact.id, "deleted": state == "deleted", "state": state, "version": fact.version}
        )
        return
    await change.engine.set_state(fact.id, "deleting", reason)
    yield SlideEvent(
        "checking", {"id": fact.id, "state": "deleting", "facts": len({q.fact_id for q in change.learned})}
    )
    patch = await change.engine.zero(fact.id, await change.engine.trainer())
    version = await change.engine.stage(patch)
    saved = await change.engine.commit(version, fact.id, "deleted", reason)
    yield SlideEvent("zeroed", {"id": fact.id, "version": version, "neurons": list(patch.neurons), "saved": saved})
    kept = await kept_after(change, version)
    yield SlideEvent(
        "checked", {"id": fact.id, "version": version, "facts": kept.facts, "kept": kept.kept, "changed": kept.changed}
    )
    state = next((f.state for f in (await change.engine.graph()).facts if f.id == fact.id), "missing")
    yield SlideEvent(
        "forgot", {"id": fact.id, "deleted": saved and state == "deleted", "state": state, "version": version}
    )


async def kept_after(change: Change, version: int) -> Kept:
    replies = await ask_all(change.ctx, [(q.prompt, q.reply_limit) for q in change.learned], version)
    return kept_facts(change.learned, replies)


# ---- starting a change: every refusal first, then the lock ----


def free_facts(graph: SlideGraph) -> int:
    pocket = graph.pocket
    return pocket.capacity - -(-pocket.neurons_used // pocket.neurons_per_fact)


async def start_learn(ctx: ServingContext, fields: LearnRequest, owner: str) -> AsyncIterator[SlideEvent]:
    """The learn's events, once its body is known to be learnable and the lock is held (400s, 503 first)."""
    await ctx.facts()  # a request sent while the model loads waits for it (503 past ready_wait_s)
    engine = SlideEngine(ctx.backend)
    change = Change(ctx, engine, owner, f"learn {owner}")
    graph = await engine.graph()
    facts, prompt_tokens = None, 0
    if fields.facts is not None:
        free = free_facts(graph)
        if len(fields.facts) > free:
            message = f"facts: the pocket has room for {free} more facts, and this body gives {len(fields.facts)}"
            raise bad_request(message, "facts", "pocket_full")
        facts = await pending_facts(change, fields.facts)
    else:
        prompt_tokens = await extraction_prompt_length(ctx, fields.text or "")
    change.learned = await learned_questions(ctx, graph.facts)
    await engine.begin(owner, change.what)
    return guarded(change, learn_events(change, facts, fields.text or "", prompt_tokens))


async def start_forget(
    ctx: ServingContext, raw_id: str, fields: ForgetRequest, owner: str
) -> AsyncIterator[SlideEvent]:
    """The delete's events, once the fact is known and the lock is held (400, 404, 503 first)."""
    wanted = fact_id(raw_id)
    await ctx.facts()
    engine = SlideEngine(ctx.backend)
    change = Change(ctx, engine, owner, f"delete of fact {wanted}")
    graph = await engine.graph()
    fact = next((f for f in graph.facts if f.id == wanted), None)
    if fact is None:
        raise APIError(404, f"id: the graph holds no fact {wanted}", "invalid_request_error", "id", "fact_not_found")
    change.learned = await learned_questions(ctx, graph.facts, leaving_out=wanted)
    await engine.begin(owner, change.what)
    return guarded(change, forget_events(change, fact, fields.reason))


async def clear_graph(ctx: ServingContext, owner: str) -> int:
    """Every fact removed from the graph (under the lock: not while a change runs); the weights keep theirs."""
    await ctx.facts()
    engine = SlideEngine(ctx.backend)
    await engine.begin(owner, "a graph clear")
    try:
        return await engine.clear_graph()
    finally:
        await engine.end(owner)
