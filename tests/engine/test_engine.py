"""The engine end to end on real (tiny random) checkpoints: exactness, caching, preemption, stops, limits.

Every test runs on the torch rank and on the MLX rank (where mlx imports: Linux runs its CPU build); the
bf16 exactness checks also at each lower CPU kernel level and on torch's kernels.
"""

import importlib.util

import pytest

from deployments.config import EngineConfig
from deployments.messages.replies import FinishReason
from deployments.messages.requests import EngineRequest, Priority, SamplingParams
from deployments.scheduler.engine.core import Engine
from kernels import cpu_native
from tests.support.kernel_levels import other_kernel_levels
from tests.support.requests import alternating, greedy, reply_tokens

NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
CASES = [
    ("bfloat16", "torch"),
    ("float32", "torch"),
    pytest.param(("bfloat16", "mlx"), marks=NO_MLX),
    pytest.param(("float32", "mlx"), marks=NO_MLX),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def checkpoint(request, tmp_path_factory) -> tuple[str, str, str]:
    dtype, backend = request.param
    return _build_checkpoint(tmp_path_factory, dtype), dtype, backend


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> tuple[str, str, str]:
    return _build_checkpoint(tmp_path_factory, "bfloat16"), "bfloat16", "torch"


def _build_checkpoint(tmp_path_factory, dtype: str) -> str:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    out = tmp_path_factory.mktemp(f"qwen3-{dtype}")
    build_random_checkpoint("qwen3", out, seed=3, dtype=dtype)
    build_tokenizer(out, family="qwen")
    return str(out)


def _engine(checkpoint: tuple[str, str, str], **overrides) -> Engine:
    path, dtype, backend = checkpoint
    settings = dict(model=path, dtype=dtype, kv_cache_gib=0.02, parallel=32, prefill_chunk_size=64, backend=backend)
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def _prompts(count: int, vocab: int = 400) -> list[list[int]]:
    return [[(7 * i + 13 * j) % vocab + 20 for j in range(10 + 5 * i)] for i in range(count)]


def _requests(prompts: list[list[int]], tag: str, max_tokens: int = 24) -> list[EngineRequest]:
    return alternating(prompts, tag, max_tokens, top_p=0.95, seed_base=1000)


def test_concurrent_equals_solo(checkpoint) -> None:
    engine = _engine(checkpoint)
    prompts = _prompts(16)
    together = reply_tokens(engine.generate(_requests(prompts, "c")), "c", 16)
    solo = [engine.generate([r])[r.request_id].token_ids for r in _requests(prompts, "s")]
    assert together == solo
    assert all(len(t) == 24 for t in together)


def test_cached_prefix_equals_fresh(checkpoint) -> None:
    prompt = _prompts(8)[7]  # 45 tokens: two full 16-token blocks to reuse
    fresh_engine = _engine(checkpoint, prompt_cache_gib=0)
    fresh = fresh_engine.generate(_requests([prompt], "f"))["f-0"]
    engine = _engine(checkpoint)
    first = engine.generate(_requests([prompt], "a"))["a-0"]
    again = engine.generate(_requests([prompt], "b"))["b-0"]
    assert fresh.stats.cached_tokens == 0 and first.stats.cached_tokens == 0
    assert again.stats.cached_tokens == 32
    assert fresh.token_ids == first.token_ids == again.token_ids


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_equals_whole(checkpoint, chunk: int) -> None:
    prompts = _prompts(8)[5:8]
    whole = _engine(checkpoint, prefill_chunk_size=512).generate(_requests(prompts, "w"))
    chunked = _engine(checkpoint, prefill_chunk_size=chunk).generate(_requests(prompts, "w"))
    assert reply_tokens(whole, "w", 3) == reply_tokens(chunked, "w", 3)
    assert max(chunked["w-2"].stats.prefill_widths) <= chunk


def test_preempted_request_equals_uninterrupted(checkpoint) -> None:
    prompts = _prompts(6)
    roomy_engine = _engine(checkpoint)
    roomy = roomy_engine.generate(_requests(prompts, "p", max_tokens=40))
    # 12 blocks of 16 tokens cannot hold six replies growing to ~75 tokens: later ones get preempted.
    block_bytes = roomy_engine.runner_info.kv_bytes_per_token * 16
    tight_engine = _engine(checkpoint, kv_cache_gib=12.5 * block_bytes / 2**30, parallel=6)
    assert tight_engine.blocks.num_blocks == 12
    tight = tight_engine.generate(_requests(prompts, "p", max_tokens=40))
    assert tight_engine.counters.preemptions_total > 0
    assert reply_tokens(roomy, "p", 6) == reply_tokens(tight, "p", 6)


@pytest.mark.parametrize("level", other_kernel_levels())
def test_replies_are_exact_at_every_kernel_level(bf16_checkpoint, level: str, monkeypatch) -> None:
    """The bf16 torch rank at each lower kernel level: concurrent = solo = chunked = cached."""
    monkeypatch.setenv("TENSORFOLD_KERNELS", level)
    assert cpu_native.level_name() == level
    prompts = _prompts(8)[4:]  # 30 to 45 tokens
    engine = _engine(bf16_checkpoint)
    together = reply_tokens(engine.generate(_requests(prompts, "c", max_tokens=12)), "c", 4)
    solo = [engine.generate([r])[r.request_id].token_ids for r in _requests(prompts, "s", max_tokens=12)]
    chunked = _engine(bf16_checkpoint, prefill_chunk_size=5).generate(_requests(prompts, "c", max_tokens=12))
    cached = engine.generate(_requests(prompts, "c", max_tokens=12))  # the prompts' full blocks are cached now
    assert together == solo == reply_tokens(chunked, "c", 4) == reply_tokens(cached, "c", 4)
    assert cached["c-3"].stats.cached_tokens == 32


def test_stop_string_cuts_text_and_ends_at_completing_token(checkpoint) -> None:
    engine = _engine(checkpoint)
    prompt = _prompts(3)[2]
    base = engine.generate([greedy("base", prompt, 30, to_limit=True)])["base"]
    text = base.text
    assert len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    stopped = engine.generate(
        [EngineRequest("stop", prompt, SamplingParams(temperature=0.0, ignore_eos=True, stop=[stop]), max_tokens=30)]
    )["stop"]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == text[:cut]
    # The reply ends at the token whose text completes the match.
    decoded = engine.tokenizer.decode(stopped.token_ids)
    assert stop in decoded and stop not in engine.tokenizer.decode(stopped.token_ids[:-1])


def test_limits_stop_ids_and_eos(checkpoint) -> None:
    engine = _engine(checkpoint)
    prompt = _prompts(2)[1]
    base = engine.generate([greedy("n", prompt, 7, to_limit=True)])["n"]
    assert base.finish_reason == FinishReason.LENGTH and len(base.token_ids) == 7
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    stopped = engine.generate(
        [
            EngineRequest(
                "i", prompt, SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]), max_tokens=7
            )
        ]
    )["i"]
    assert stopped.finish_reason == FinishReason.STOP and stopped.token_ids == base.token_ids[: first + 1]


def test_context_refusals_carry_the_numbers(checkpoint) -> None:
    engine = _engine(checkpoint, context=64)
    refused = engine.check(EngineRequest("x", list(range(20, 60)), max_tokens=30, prompt_param="prompt"))
    assert refused is not None and refused.code == "context_length_exceeded" and refused.status == 400
    assert refused.param == "prompt"  # every context refusal names the prompt's field, as OpenAI does
    expected = (
        "This server's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(40 in the prompt, 30 for the reply). Please shorten the prompt or reduce the reply limit."
    )
    assert refused.message == expected
    whole = engine.check(EngineRequest("y", list(range(20, 84)), prompt_param="prompt"))
    assert whole is not None and whole.code == "context_length_exceeded" and whole.param == "prompt"
    assert whole.message.startswith("This server's maximum context length is 64 tokens. However, your prompt has 64")
    # The engine's own admission gives the same refusal, as a value (nothing is admitted).
    over = EngineRequest("x", list(range(20, 60)), max_tokens=30, prompt_param="prompt")
    completion = engine.generate([over])["x"]
    assert completion.refusal == refused and completion.token_ids == [] and not engine.has_work()
    # An omitted limit is capped to what the prompt leaves.
    reply = engine.generate([greedy("z", list(range(20, 60)), to_limit=True)])["z"]
    assert len(reply.token_ids) == 24 and reply.finish_reason == FinishReason.LENGTH


def test_background_prompt_yields_to_foreground(checkpoint) -> None:
    engine = _engine(checkpoint, prefill_chunk_size=8)
    prompts = _prompts(8)
    background = greedy("bg", prompts[7], 4, to_limit=True, priority=Priority.BACKGROUND)
    foreground = greedy("fg", prompts[6], 4, to_limit=True)
    replies = engine.generate([background, foreground])
    assert replies["fg"].stats.first_token_time <= replies["bg"].stats.first_token_time
    solo = engine.generate([greedy("bg2", prompts[7], 4, to_limit=True)])
    assert replies["bg"].token_ids == solo["bg2"].token_ids
