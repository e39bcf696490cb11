"""Label scoring in the engine: a request that reads the next-token distribution and generates nothing.

Scores must be the float64 log-softmax of the model's own next-token logits at the prompt's end, the same
alone or batched beside running replies, with no reply token; the replies next to it must not change.
"""

from dataclasses import replace

import pytest
import torch

from deployments.config import EngineConfig
from deployments.messages.engine_process import Inbox
from deployments.messages.replies import FinishReason
from deployments.messages.requests import EngineRequest, GrammarSpec
from deployments.model_rank.models import load_model
from deployments.scheduler.engine.core import Engine
from tests.support.model_harness import PagedHarness
from tests.support.requests import greedy, sampled

LABELS = [32, 33, 34, 15, 16, 725]  # "A", "B", "C", "0", "1" and an end token in tiny-glm's vocabulary


@pytest.fixture(scope="module")
def model_dir(served_model: str) -> str:
    from serve_app.args import AppArgs

    return str(AppArgs(model=served_model).model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    return Engine(
        EngineConfig(model=model_dir, context=256, kv_cache_gib=0.02, parallel=8, device="cpu", prefill_chunk_size=24)
    )


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(11 * j + offset) % 600 + 60 for j in range(length)]


def _scoring(request_id: str, prompt: list[int], labels: list[int] = LABELS) -> EngineRequest:
    return greedy(request_id, prompt, score_token_ids=list(labels))


def _reply(request_id: str, prompt: list[int]) -> EngineRequest:
    return sampled(request_id, prompt, seed=5, temperature=0.7, max_tokens=20, to_limit=True)


def _scores(engine: Engine, request: EngineRequest) -> list[float]:
    """Run the request alone and return its scores (checking nothing was generated)."""
    replies = engine.generate([request])
    assert list(replies) == [request.request_id]  # no chunk for anything else
    final = replies[request.request_id]
    assert not final.token_ids and not final.text
    assert final.finish_reason == FinishReason.STOP and final.scores is not None
    assert final.stats.completion_tokens == 0 and final.stats.prompt_tokens == len(request.prompt_token_ids)
    return final.scores


def test_scores_are_the_models_next_token_log_softmax(engine: Engine, model_dir: str) -> None:
    prompt = _prompt(50)  # longer than one prefill chunk
    logits = PagedHarness(load_model(model_dir, dtype="float32")).prefill(0, prompt).float()
    expected = torch.log_softmax(logits.to(torch.float64), dim=-1)[LABELS].tolist()
    scores = _scores(engine, _scoring("solo", prompt))
    assert scores == pytest.approx(expected, abs=1e-9)
    assert all(s < 0 for s in scores)


def test_scoring_beside_running_replies_equals_solo(engine: Engine) -> None:
    prompts = [_prompt(30 + 7 * i, offset=i) for i in range(4)]
    solo_scores = [_scores(engine, _scoring(f"alone-{i}", p)) for i, p in enumerate(prompts)]
    solo_reply = engine.generate([_reply("reply-solo", _prompt(40, offset=9))])["reply-solo"]
    tokens: list[int] = []
    inbox = Inbox(adds=[_reply("reply-mixed", _prompt(40, offset=9))])
    while len(tokens) < 3:  # the reply is decoding when the scoring prompts arrive
        tokens.extend(t for chunk in engine.run_once(inbox).chunks for t in chunk.token_ids)
        inbox = Inbox()
    finals = engine.generate([_scoring(f"mixed-{i}", prompt) for i, prompt in enumerate(prompts)])
    for request_id, final in finals.items():
        scored = request_id.startswith("mixed")
        assert final.finish_reason == (FinishReason.STOP if scored else FinishReason.LENGTH)
        assert not final.token_ids or not scored
    assert [finals[f"mixed-{i}"].scores for i in range(4)] == solo_scores
    assert finals["reply-mixed"].scores is None
    tokens.extend(finals["reply-mixed"].token_ids)  # what the reply wrote while the scoring requests ran
    assert tokens == solo_reply.token_ids and len(tokens) == 20


def _refusal_message(engine: Engine, request: EngineRequest) -> str:
    refusal = engine.check(request)
    assert refusal is not None and refusal.status == 400 and refusal.param == "messages"
    return refusal.message


def test_scoring_refusals(engine: Engine) -> None:
    vocab = engine.runner_info.vocab_size
    assert "outside the vocabulary" in _refusal_message(engine, _scoring("bad-id", _prompt(5), [1, vocab]))
    assert "empty" in _refusal_message(engine, _scoring("no-ids", _prompt(5), []))
    with_logprobs = replace(_scoring("logprobs", _prompt(5)), logprobs=2)
    assert "grammar or ask for logprobs" in _refusal_message(engine, with_logprobs)
    with_grammar = replace(_scoring("grammar", _prompt(5)), grammar=GrammarSpec(kind="regex", source="a+"))
    assert "grammar or ask for logprobs" in _refusal_message(engine, with_grammar)
