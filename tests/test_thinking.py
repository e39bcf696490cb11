"""Thinking budget and loop guard: the pure rule, then the engine writing it on tiny-glm."""

import pytest

from deployments.scheduler.thinking import LOOP_MATCHES, LOOP_START, force_tokens, loop_period
from deployments.types import ThinkingControls

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
    from deployments.ingress.finish_log import log_finished
    from deployments.ingress.usage import summarise
    from deployments.renderer.prompt_renderer import ReplyFormat
    from deployments.types import RequestStats, SamplingParams

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
    from deployments.config import EngineConfig
    from deployments.renderer.prompt_renderer import PromptRenderer
    from deployments.scheduler.engine import Engine
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    engine = Engine(EngineConfig(model=str(model_dir), context=256, kv_cache_gib=0.05, device="cpu"))
    return engine, PromptRenderer.from_checkpoint(model_dir)


def test_engine_forces_the_close_identically_solo_and_batched(glm) -> None:
    from deployments.ingress.request_builder import thinking_controls
    from deployments.renderer.prompt_renderer import ChatRenderRequest
    from deployments.types import EngineRequest, SamplingParams
    from tests.engine_harness import run_to_end

    engine, renderer = glm
    rendered = renderer.render_chat(ChatRenderRequest([{"role": "user", "content": "What is 17 * 3?"}]))
    other = renderer.render_chat(ChatRenderRequest([{"role": "user", "content": "Tell me a story."}]))
    watch = thinking_controls(rendered.reply, 5, 0, loop_guard=False)
    assert watch is not None and watch.budget == 5

    def request(tag: str, prompt: list[int], thinking: ThinkingControls | None) -> EngineRequest:
        return EngineRequest(tag, prompt, SamplingParams(temperature=0.0), max_tokens=12, thinking=thinking)

    solo = run_to_end(engine, [request("solo", rendered.prompt_token_ids, watch)])["solo"]
    batch = run_to_end(engine, [request("story", other.prompt_token_ids, None),
                                request("batched", rendered.prompt_token_ids, watch)])  # fmt: skip
    assert solo.token_ids == batch["batched"].token_ids and solo.text == batch["batched"].text
    close = rendered.reply.think_close_ids
    assert solo.token_ids[0] == rendered.reply.think_opener_id and solo.token_ids[4:4 + len(close)] == close
    assert solo.text.startswith("<think>17 * 3") and "\n</think>\n\n" in solo.text  # corpus: "17 * 3 = 10..."
