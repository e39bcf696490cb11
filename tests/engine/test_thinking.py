"""Thinking budget and loop guard: the pure rule, then the engine writing it (tiny-glm for the budget, a random
checkpoint that falls into an exact cycle for the loop guard), and the route reporting it."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from deployments.messages.render import ReplyFormat
from deployments.messages.requests import ThinkingControls
from deployments.scheduler.engine.completion import Completion
from deployments.scheduler.engine.thinking import LOOP_MATCHES, LOOP_START, MAX_PERIOD, force_tokens, loop_period

OPEN, CLOSE, CLOSE_IDS = 5, 6, [1, 6, 2]


def controls(**kw) -> ThinkingControls:
    return ThinkingControls(**{"opener_id": OPEN, "closer_id": CLOSE, "close_ids": CLOSE_IDS, **kw})


def test_budget_replaces_the_budget_th_token_while_thinking() -> None:
    budget = controls(prompt_opens=True, budget=4)
    assert force_tokens([10, 11], 12, budget) is None
    assert force_tokens([10, 11, 12], 13, budget).token_ids == CLOSE_IDS  # the 4th reply token
    assert force_tokens([10, CLOSE, 12], 13, budget) is None  # the model closed the block earlier
    assert force_tokens([10, 11, 12], CLOSE, budget) is None  # closing on its own is left alone
    # A reply that opens the block itself counts its opener; one that never opens it is not thinking.
    assert force_tokens([OPEN, 11, 12], 13, controls(budget=4)) is not None
    assert force_tokens([20, 11, 12], 13, controls(budget=4)) is None
    assert force_tokens([10, 11, 12], 13, controls(prompt_opens=True)) is None  # no budget, no guard


def _looping(prefix: int, period: int, total: int) -> list[int]:
    """`prefix` distinct tokens, then a cycle of `period` tokens until `total` tokens."""
    head = [100 + i for i in range(prefix)]
    return head + [200 + (i % period) for i in range(total - prefix)]


@pytest.mark.parametrize("period", [1, 3, 8])
def test_loop_guard_fires_at_the_256th_predecessor_match(period: int) -> None:
    tokens = _looping(LOOP_START, period, LOOP_START + period + LOOP_MATCHES + 5)
    fired = [i for i in range(1, len(tokens)) if loop_period(tokens[:i], tokens[i]) is not None]
    # The region starts at LOOP_START; its first match is at LOOP_START + period.
    assert fired[0] == LOOP_START + period + LOOP_MATCHES - 1
    assert loop_period(tokens[: fired[0]], tokens[fired[0]]) == period
    guard = controls(prompt_opens=True, loop_guard=True)
    forced = force_tokens(tokens[: fired[0]], tokens[fired[0]], guard)
    assert forced is not None and forced.loop_period == period and forced.token_ids == CLOSE_IDS
    assert force_tokens(tokens[: fired[0]], tokens[fired[0]], controls(loop_guard=True)) is None  # not thinking


def test_loop_guard_ignores_cycles_starting_early_and_longer_periods() -> None:
    early = _looping(LOOP_START - 10, 2, 400)
    starts = [i for i in range(1, len(early)) if loop_period(early[:i], early[i]) is not None]
    # The repeated region must start at least LOOP_START tokens in: it fires later than it would otherwise.
    assert starts and starts[0] == LOOP_START + 2 + LOOP_MATCHES - 1
    long_cycle = _looping(LOOP_START, 9, 600)
    assert all(loop_period(long_cycle[:i], long_cycle[i]) is None for i in range(1, len(long_cycle)))


def test_a_guarded_reply_reports_its_period(caplog: pytest.LogCaptureFixture) -> None:
    from deployments.ingress.http.finish_log import log_finished
    from deployments.ingress.usage import summarise
    from deployments.messages.render import ReplyFormat
    from deployments.messages.replies import RequestStats
    from deployments.messages.requests import SamplingParams

    summary = summarise([1, 2], RequestStats(completion_tokens=2, loop_period=3), SamplingParams(), ReplyFormat(), "t")
    assert summary.runtime_block()["loop"] == {"period": 3}
    with caplog.at_level("INFO", logger="tensorfold.requests"):
        log_finished("chatcmpl-x", summary, "stop")
    assert "loop=period:3" in caplog.text
    plain = summarise([1], RequestStats(completion_tokens=1), SamplingParams(), ReplyFormat(), "t")
    assert "loop" not in plain.runtime_block()


# ---- the engine writes it -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def glm(served_model: str):
    from deployments.chat_format.rendering import PromptRenderer
    from deployments.config import EngineConfig
    from deployments.scheduler.engine.core import Engine
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    engine = Engine(EngineConfig(model=str(model_dir), context=256, kv_cache_gib=0.05, device="cpu"))
    return engine, PromptRenderer.from_checkpoint(model_dir)


def test_engine_forces_the_close_identically_solo_and_batched(glm) -> None:
    from deployments.ingress.engine_request import thinking_controls
    from deployments.messages.render import ChatRenderRequest
    from deployments.messages.requests import EngineRequest, SamplingParams

    engine, renderer = glm
    rendered = renderer.render_chat(ChatRenderRequest([{"role": "user", "content": "What is 17 * 3?"}]))
    other = renderer.render_chat(ChatRenderRequest([{"role": "user", "content": "Tell me a story."}]))
    watch = thinking_controls(rendered.reply, 5, 0, loop_guard=False)
    assert watch is not None and watch.budget == 5

    def request(tag: str, prompt: list[int], thinking: ThinkingControls | None) -> EngineRequest:
        return EngineRequest(tag, prompt, SamplingParams(temperature=0.0), max_tokens=12, thinking=thinking)

    solo = engine.generate([request("solo", rendered.prompt_token_ids, watch)])["solo"]
    batch = engine.generate(
        [request("story", other.prompt_token_ids, None), request("batched", rendered.prompt_token_ids, watch)]
    )
    assert solo.token_ids == batch["batched"].token_ids and solo.text == batch["batched"].text
    close = rendered.reply.think_close_ids
    assert solo.token_ids[0] == rendered.reply.think_opener_id and solo.token_ids[4 : 4 + len(close)] == close
    # The corpus's "17 * 3 = 10..." starts "1", "7", " *": with <think>, four of the budget's five tokens;
    # the fifth is the forced "\n".
    assert solo.text.startswith("<think>17 *\n</think>\n\n")


# ---- the loop guard on a model that loops -----------------------------------------------------------------
LOOP_SEED, LOOP_PROMPT = 1, "Paris"  # greedy on these random weights falls into an exact cycle right away
# A cycle that starts early fires by this reply position; the rest shows the answer continuing.
LOOP_MAX_TOKENS = LOOP_START + MAX_PERIOD + LOOP_MATCHES + 12
CLOSED_WHEN_OFF = "        {{- '<think></think>' -}}\n    {%- endif -%}"
OPEN_OTHERWISE = "        {{- '<think></think>' -}}\n    {%- else -%}\n        {{- '<think>' -}}\n    {%- endif -%}"


def open_thinking_in_prompt(model_dir: Path) -> Path:
    """Make the generation prompt end inside an open think block when thinking is on (as thinking-only
    templates do), so the guard watches the reply from its first token."""
    path = model_dir / "chat_template.jinja"
    source = path.read_text(encoding="utf-8")
    assert source.count(CLOSED_WHEN_OFF) == 1, "tiny-glm's template closes the block with thinking off here"
    path.write_text(source.replace(CLOSED_WHEN_OFF, OPEN_OTHERWISE), encoding="utf-8")
    return model_dir


@pytest.fixture(scope="module")
def looping_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import build_glm_checkpoint

    return open_thinking_in_prompt(build_glm_checkpoint(tmp_path_factory.mktemp("looping-glm"), seed=LOOP_SEED))


@dataclass
class LoopRuns:
    """The looping prompt decoded greedily with and without the guard (the guarded one solo and batched)."""

    prompt_token_ids: list[int]
    reply: ReplyFormat
    free: Completion  # unguarded, batched beside `batched`
    batched: Completion
    solo: Completion


@pytest.fixture(scope="module")
def loop_runs(looping_dir: Path) -> LoopRuns:
    from deployments.chat_format.rendering import PromptRenderer
    from deployments.config import EngineConfig
    from deployments.ingress.engine_request import thinking_controls
    from deployments.messages.render import ChatRenderRequest
    from deployments.messages.requests import EngineRequest, SamplingParams
    from deployments.scheduler.engine.core import Engine

    rendered = PromptRenderer.from_checkpoint(looping_dir).render_chat(
        ChatRenderRequest([{"role": "user", "content": LOOP_PROMPT}])
    )
    guard = thinking_controls(rendered.reply, None, 0, loop_guard=True)
    assert guard is not None and guard.loop_guard and guard.budget == 0
    context = len(rendered.prompt_token_ids) + LOOP_MAX_TOKENS + 16
    engine = Engine(EngineConfig(model=str(looping_dir), context=context, kv_cache_gib=0.05, device="cpu"))

    def request(tag: str, thinking: ThinkingControls | None) -> EngineRequest:
        sampling = SamplingParams(temperature=0.0)
        return EngineRequest(tag, rendered.prompt_token_ids, sampling, max_tokens=LOOP_MAX_TOKENS, thinking=thinking)

    batch = engine.generate([request("free", None), request("batched", guard)])
    solo = engine.generate([request("solo", guard)])["solo"]
    return LoopRuns(rendered.prompt_token_ids, rendered.reply, batch["free"], batch["batched"], solo)


def _rule_fires(tokens: list[int]) -> tuple[int, int]:
    """Where the loop rule, run over an unguarded reply, first fires, and the period it reports."""
    fire = next(i for i in range(1, len(tokens)) if loop_period(tokens[:i], tokens[i]) is not None)
    period = loop_period(tokens[:fire], tokens[fire])
    assert period is not None
    return fire, period


def test_engine_loop_guard_closes_a_real_loop_where_the_rule_says(loop_runs: LoopRuns) -> None:
    from deployments.messages.replies import FinishReason

    reply, free, batched, solo = loop_runs.reply, loop_runs.free, loop_runs.batched, loop_runs.solo
    assert reply.prompt_opens_thinking
    assert solo.token_ids == batched.token_ids and solo.text == batched.text
    # Unguarded, the model never closes the block; the rule, run over its tokens, says where the guard fires.
    assert reply.think_closer_id not in free.token_ids and free.finish_reason == FinishReason.LENGTH
    fire, period = _rule_fires(free.token_ids)
    assert period <= MAX_PERIOD and fire >= LOOP_START + period + LOOP_MATCHES - 1
    close = reply.think_close_ids
    assert batched.token_ids[:fire] == free.token_ids[:fire] and batched.token_ids[fire : fire + len(close)] == close
    assert batched.stats is not None and batched.stats.loop_period == period
    assert free.stats is not None and free.stats.loop_period is None
    # The answer continues after the forced close, up to the reply limit.
    assert batched.finish_reason == FinishReason.LENGTH
    assert len(batched.token_ids) == LOOP_MAX_TOKENS > fire + len(close)
    assert "\n</think>\n\n" in batched.text and reply.think_closer_id not in batched.token_ids[fire + len(close) :]


def test_the_route_reports_the_loop_period(looping_dir: Path, loop_runs: LoopRuns) -> None:
    from fastapi.testclient import TestClient

    from deployments.ingress.app import build_api
    from deployments.ingress.context import IngressSettings
    from tests.support.local_app import local_backend

    _, period = _rule_fires(loop_runs.free.token_ids)
    settings = IngressSettings(served_name="looping", model_ids=["looping"], loop_guard=True)
    window = len(loop_runs.prompt_token_ids) + LOOP_MAX_TOKENS + 16
    with local_backend(str(looping_dir), window=window) as backend, TestClient(build_api(backend, settings)) as client:
        body = {
            "model": "looping",
            "messages": [{"role": "user", "content": LOOP_PROMPT}],
            "temperature": 0,
            "max_tokens": LOOP_MAX_TOKENS,
        }
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["tensorfold"]["loop"] == {"period": period}
    assert answer["usage"]["completion_tokens"] == len(loop_runs.solo.token_ids)
    # The same reply as the engine's solo run: the loop as reasoning, the answer after the forced close.
    reasoning, content = loop_runs.solo.text.split("\n</think>\n\n")
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning and message["content"] == content
    assert answer["choices"][0]["finish_reason"] == "length"
