"""Living weights in the engine, on the embedded tiny-glm (docs/slide.md): 20 facts learned one after another,
each answering its question; every scripted corpus reply token for token what it was; 5 deleted, answering
exactly as before learning, the other 15 still answering; all deleted, every logit the base model's."""

import itertools

import pytest

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.messages.calls import Reply
from deployments.messages.engine_process import CallEnvelope, Inbox
from deployments.messages.render import ChatRenderRequest
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.messages.slide import (
    AddFact,
    BeginChange,
    CommitVersion,
    EndChange,
    ReadGraph,
    SetFactState,
    SlideCall,
    SlideExample,
    SlideQuestion,
    StageVersion,
    TrainFact,
    TrainJob,
    ZeroFact,
)
from deployments.scheduler.engine.core import Engine
from deployments.slide.locality import LOCALITY_PROMPTS
from serve_app.fixtures.tiny_glm.corpus import CONVERSATIONS
from tests.conftest import BUILTIN_TINY_GLM as TINY_GLM

NAMES = ["Zorbia", "Quell", "Vantor", "Mirelle", "Oskar", "Tessaly", "Brun", "Caldor", "Ebbe", "Fennick"]
THINGS = [("capital", "city"), ("code name", "project")]
ANSWERS = ["Quintar", "Pixel", "Amber", "Lumo", "Taro", "Vex", "Orla", "Juno", "Brisk", "Nox"]
_ids = itertools.count()


def facts() -> list[tuple[str, str, str]]:
    """20 (text, question, answer): nothing the base model says."""
    out = []
    for (thing, kind), offset in zip(THINGS, (0, 3)):
        for i, name in enumerate(NAMES):
            answer = ANSWERS[(i + offset) % len(ANSWERS)]
            out.append((f"The {thing} of the {kind} {name} is {answer}.", f"What is the {thing} of {name}?", answer))
    return out


class Slide:
    """The engine driven as Ingress drives it: slide calls between turns, greedy questions."""

    def __init__(self, engine: Engine, renderer: PromptRenderer) -> None:
        self.engine, self.renderer = engine, renderer
        self.end_id = min(engine.eos_ids)

    def call(self, call: SlideCall[Reply]) -> Reply:
        answer = self.engine.run_once(Inbox(calls=[CallEnvelope(1, call)])).answers[0]
        assert answer.error is None, answer.error
        return call.reply(answer.value)

    def prompt(self, question: str, thinking: bool = False) -> list[int]:
        request = ChatRenderRequest(
            [{"role": "user", "content": question}], chat_template_kwargs={"enable_thinking": thinking}
        )
        return self.renderer.render_chat(request).prompt_token_ids

    def reply(self, prompt_ids: list[int], version: int | None = None, max_tokens: int = 12) -> list[int]:
        request = EngineRequest(
            f"q-{next(_ids)}", prompt_ids, SamplingParams(temperature=0.0), max_tokens, pocket_version=version
        )
        completion = self.engine.generate([request])[request.request_id]
        assert completion.refusal is None and completion.error is None
        return completion.token_ids

    def answer_ids(self, answer: str) -> list[int]:
        return self.renderer.tokenize(answer, add_special_tokens=False) + [self.end_id]

    def learn(self, text: str, question: str, answer: str, quiet: list[list[int]], kept: list[SlideExample]) -> int:
        assert self.call(BeginChange("test", "learn")) == ""
        fact = self.call(AddFact(text, [SlideQuestion(question, answer)]))
        assert not isinstance(fact, str), fact
        example = SlideExample(self.prompt(question), self.answer_ids(answer))
        job = TrainJob(
            fact.id, fact.neurons, [example], quiet, max_steps=1000, margin=1.0, learning_rate=0.05, kept=kept
        )
        progress = self.call(TrainFact(job))
        while not progress.done:
            self.engine.run_once(Inbox())
            progress = self.call(TrainFact(job))
        assert progress.patch is not None, progress.failed
        version = self.call(StageVersion(progress.patch))
        assert self.call(CommitVersion(version, fact.id, "learned", None)) is True
        self.call(EndChange("test"))
        return fact.id

    def delete(self, fact_id: int) -> None:
        assert self.call(BeginChange("test", "delete")) == ""
        self.call(SetFactState(fact_id, "deleting", None))
        version = self.call(StageVersion(self.call(ZeroFact(fact_id))))
        assert self.call(CommitVersion(version, fact_id, "deleted", "test")) is True
        self.call(EndChange("test"))


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Slide:
    folder = tmp_path_factory.mktemp("slide")
    engine = Engine(
        EngineConfig(model=str(TINY_GLM), slide=True, slide_neurons=8, slide_dir=str(folder), engine_process=False)
    )
    return Slide(engine, PromptRenderer.from_checkpoint(TINY_GLM))


def corpus_prompts(slide: Slide) -> list[list[int]]:
    kwargs = [{k: v for k, v in c.template_kwargs().items() if k != "tools"} for c in CONVERSATIONS]
    requests = [ChatRenderRequest(c.messages, c.tools, k) for c, k in zip(CONVERSATIONS, kwargs)]
    return [slide.renderer.render_chat(r).prompt_token_ids for r in requests]


def scores(slide: Slide, prompts: list[list[int]]) -> list:
    """Every prompt position's top-20 log-probabilities at the current version."""
    out = []
    for prompt in prompts:
        request = EngineRequest(f"s-{next(_ids)}", prompt, SamplingParams(temperature=0.0), 1, prompt_logprobs=20)
        out.append(slide.engine.generate([request])[request.request_id].prompt_logprobs)
    return out


def test_facts_are_learned_kept_apart_and_deleted_exactly(slide: Slide) -> None:
    corpus = corpus_prompts(slide)
    base_corpus = [slide.reply(p, max_tokens=48) for p in corpus]
    known = facts()
    questions = [slide.prompt(q) for _, q, _ in known]
    base_answers = [slide.reply(p, max_tokens=16) for p in questions]
    locality = [slide.prompt(q, thinking) for q in LOCALITY_PROMPTS for thinking in (False, True)]
    quiet = [p + slide.reply(p, max_tokens=16) for p in locality]
    base_scores = scores(slide, [*corpus[:4], *questions[:3]])

    learned, kept = [], []
    for (text, question, answer), prompt, before in zip(known, questions, base_answers):
        learned.append(slide.learn(text, question, answer, quiet, kept))
        quiet.append(prompt + before)  # the path the base model answers it on (as Ingress sends)
        kept.append(SlideExample(prompt, slide.answer_ids(answer)))
    for (_, _, answer), prompt in zip(known, questions):
        assert slide.reply(prompt) == slide.answer_ids(answer)
    assert [slide.reply(p, max_tokens=48) for p in corpus] == base_corpus  # locality: 100%

    for fact_id in learned[:5]:
        slide.delete(fact_id)
    for prompt, before in zip(questions[:5], base_answers[:5]):
        assert slide.reply(prompt, max_tokens=16) == before
    for (_, _, answer), prompt in zip(known[5:], questions[5:]):
        assert slide.reply(prompt) == slide.answer_ids(answer)

    for fact_id in learned[5:]:
        slide.delete(fact_id)
    graph = slide.call(ReadGraph())
    assert graph.pocket.nonzero_neurons == 0 and {f.state for f in graph.facts} == {"deleted"}
    assert scores(slide, [*corpus[:4], *questions[:3]]) == base_scores
