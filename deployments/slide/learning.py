"""A learn, fact by fact, as events (docs/slide.md, Learning a fact): the fact added to the graph, trained on
the trainer replica slice by slice, its version staged on every replica and judged, then committed
(`learned`) or dropped (`failed`)."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from deployments.messages.slide import SlideFact, SlideQuestion, TrainJob, TrainProgress
from deployments.messages.slide_changes import (
    CheckFigures,
    FactBody,
    FactEvent,
    FailedEvent,
    LearnedEvent,
    LearningEvent,
    SlideEvent,
)
from deployments.slide.asking import Prompt, ask_all
from deployments.slide.changes import Change, shielded
from deployments.slide.checks import Locality, Question, fact_questions, judge, locality_baseline
from deployments.slide.context import SlideRefused
from deployments.slide.extraction import extract_facts
from deployments.slide.locality import LOCALITY_REPLY_TOKENS

log = logging.getLogger("tensorfold.slide")
TRAIN_SLICE_S = 0.25  # how often the trainer is asked for progress: a learning event at least this often


@dataclass
class Pending:
    """A fact to learn, its questions already rendered (their fact id is set once the graph adds it)."""

    body: FactBody
    questions: list[Question]


async def pending_facts(change: Change, bodies: list[FactBody], param: str = "facts") -> list[Pending]:
    return [
        Pending(body, await fact_questions(change.ctx, 0, _pairs(body), f"{param}[{i}]"))
        for i, body in enumerate(bodies)
    ]


def _pairs(body: FactBody) -> list[SlideQuestion]:
    return [SlideQuestion(q.question, q.answer) for q in body.questions]


async def extracted_facts(change: Change, prompt: Prompt, key_label: str) -> list[Pending] | FailedEvent:
    """The facts the served model finds in the text `prompt` asks about, or the `failed` event saying why none."""
    extracted = await extract_facts(change.ctx, prompt, key_label)
    if extracted.reason is not None:
        return FailedEvent(id=None, reason=f"no facts to learn: {extracted.reason}")
    try:
        return await pending_facts(change, extracted.facts, "extracted")
    except SlideRefused as exc:
        return FailedEvent(id=None, reason=f"the extracted facts cannot be asked: {exc.message}")


async def learn_events(change: Change, facts: list[Pending]) -> AsyncIterator[SlideEvent]:
    """Each fact's events in turn."""
    baseline = await locality_baseline(change.ctx)
    trainer = await change.engine.trainer()
    for pending in facts:
        await change.engine.begin(change.owner, change.what)  # renews the lock's lease for this fact
        async with aclosing(learn_fact(change, pending, baseline, trainer)) as steps:
            async for event in steps:
                yield event


async def learn_text_events(change: Change, prompt: Prompt, key_label: str) -> AsyncIterator[SlideEvent]:
    """The text's facts extracted, then each one's events (or one `failed` event when there are none)."""
    facts = await extracted_facts(change, prompt, key_label)
    if isinstance(facts, FailedEvent):
        yield facts
        return
    async with aclosing(learn_events(change, facts)) as events:
        async for event in events:
            yield event


async def learn_fact(
    change: Change, pending: Pending, baseline: list[Locality], trainer: str
) -> AsyncIterator[SlideEvent]:
    """fact, learning..., then learned or failed; a learn stopped on the way leaves the fact failed."""
    started = time.monotonic()
    added = await change.engine.add_fact(pending.body.text, _pairs(pending.body))
    if isinstance(added, str):
        yield FailedEvent(id=None, text=pending.body.text, reason=added)
        return
    for question in pending.questions:
        question.fact_id = added.id
    staged: list[int] = []  # the version staged for its checks, once it is
    settled = False
    try:
        yield FactEvent(added)
        progress = TrainProgress()
        async for event in train(change, added, pending.questions, baseline, trainer, progress):
            yield event
        if progress.patch is None:
            settled = True
            yield await fail(change, added.id, progress.failed or "training ended without a fit")
            return
        staged.append(await change.engine.stage(progress.patch))
        event = await check_and_commit(change, added.id, staged[0], pending.questions, baseline, progress, started)
        settled = True
        yield event
    finally:
        if not settled:
            await shielded(_abandon(change, added.id, staged))


async def check_and_commit(
    change: Change,
    fact: int,
    version: int,
    questions: list[Question],
    baseline: list[Locality],
    progress: TrainProgress,
    started: float,
) -> SlideEvent:
    """Judge the staged version: commit it (learned) or drop it (failed)."""
    verdict = await judge(change.ctx, version, questions, change.learned, baseline)
    if verdict.reason is not None:
        await change.engine.drop(version)
        return await fail(change, fact, verdict.reason, version, verdict.figures())
    saved = await change.engine.commit(version, fact, "learned", None)
    change.learned += questions
    steps = progress.steps[-1][0] if progress.steps else 0
    seconds = round(time.monotonic() - started, 3)
    return LearnedEvent(fact, version, saved, verdict.figures(), steps, seconds)


async def _abandon(change: Change, fact: int, staged: list[int]) -> None:
    """A learn that stopped mid-fact (the client left, an engine call failed): its version dropped, the fact
    failed, so no neurons stay held by a fact nobody is learning."""
    try:
        for version in staged:
            await change.engine.drop(version)
        await change.engine.set_state(fact, "failed", "the learn stopped before its checks ended")
    except Exception:
        log.warning("could not settle fact %d after its learn stopped", fact, exc_info=True)


async def fail(
    change: Change, fact: int, reason: str, version: int | None = None, checked: CheckFigures | None = None
) -> FailedEvent:
    await change.engine.set_state(fact, "failed", reason)
    return FailedEvent(id=fact, reason=reason, version=version, checked=checked)


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
    job = await train_job(change, fact, questions, baseline)
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
            yield LearningEvent(fact.id, step, loss, right, progress.answer_rows)


async def train_job(change: Change, fact: SlideFact, questions: list[Question], baseline: list[Locality]) -> TrainJob:
    """What the trainer fits: the fact's examples, silent on the quiet rows, keeping the other answers."""
    settings = change.ctx.settings
    # The other facts' questions stay quiet along the path the base model (version 0) answers them on, so a
    # deleted fact's question answers as before it was learned; their answers are kept.
    learned = change.learned
    base_replies = await ask_all(change.ctx, [(q.prompt, LOCALITY_REPLY_TOKENS) for q in learned], 0)
    quiet = [b.quiet for b in baseline] + [q.prompt.ids + r.token_ids for q, r in zip(learned, base_replies)]
    examples = [q.example for q in questions]
    return TrainJob(
        fact.id, list(fact.neurons), examples, quiet, settings.slide_steps, settings.slide_margin,
        settings.slide_learning_rate, kept=[q.example for q in learned],
    )  # fmt: skip
