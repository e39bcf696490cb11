"""Hybrid models in the engine (recurrent layers beside attention, on tiny random checkpoints): replies are
the same solo and batched, whole and chunked, fresh and resumed from a state snapshot, preempted or not,
drafted or serial; a conversation's next turn finds its previous prompt cached; snapshots obey their cap.

Every test runs on the torch rank and on the MLX rank (where mlx imports: Linux runs its CPU build).
"""

import importlib.util
from dataclasses import replace

import pytest

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams
from deployments.scheduler.engine.core import Engine
from tests.support.requests import alternating, greedy, reply_tokens

# One model per mixer and layout (the rest share these files; tests/rank checks each against transformers):
# Qwen3-Next's grouped projections and MoE, Qwen3.5's multimodal checkpoint with split projections, Mamba2.
ENGINE_ARCHS = ("qwen3_next", "qwen3_5", "nemotron_h")
NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
CASES = [(arch, dtype, "torch") for arch in ENGINE_ARCHS for dtype in ("float32", "bfloat16")] + [
    pytest.param((arch, dtype, "mlx"), marks=NO_MLX) for arch in ENGINE_ARCHS for dtype in ("float32", "bfloat16")
]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def checkpoint(request, tmp_path_factory) -> tuple[str, str, str]:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    arch, dtype, backend = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
    build_random_checkpoint(arch, out, seed=5, dtype=dtype)
    build_tokenizer(out, family="qwen")
    return str(out), dtype, backend


def _engine(checkpoint: tuple[str, str, str], **overrides) -> Engine:
    path, dtype, backend = checkpoint
    settings = dict(
        model=path, dtype=dtype, kv_cache_gib=0.02, parallel=16, prefill_chunk_size=64, draft="off", backend=backend
    )
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def _prompts(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 400 + 20 for j in range(9 + 6 * i)] for i in range(count)]


def _requests(prompts: list[list[int]], tag: str, max_tokens: int = 20) -> list[EngineRequest]:
    return alternating(prompts, tag, max_tokens, top_p=0.9, seed_base=77)


def test_concurrent_equals_solo(checkpoint) -> None:
    engine = _engine(checkpoint)
    prompts = _prompts(8)
    together = reply_tokens(engine.generate(_requests(prompts, "c")), "c", 8)
    fresh = _engine(checkpoint, prompt_cache_gib=0)
    solo = [fresh.generate([r])[r.request_id].token_ids for r in _requests(prompts, "s")]
    assert together == solo and all(len(t) == 20 for t in together)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_equals_whole(checkpoint, chunk: int) -> None:
    prompts = _prompts(6)[3:6]
    whole = _engine(checkpoint, prefill_chunk_size=512).generate(_requests(prompts, "w"))
    chunked = _engine(checkpoint, prefill_chunk_size=chunk).generate(_requests(prompts, "w"))
    assert reply_tokens(whole, "w", 3) == reply_tokens(chunked, "w", 3)
    assert max(chunked["w-2"].stats.prefill_widths) <= chunk


def test_a_resumed_prefix_equals_a_fresh_prompt_and_the_next_turn_finds_the_last_cached(checkpoint) -> None:
    engine = _engine(checkpoint)
    fresh_engine = _engine(checkpoint, prompt_cache_gib=0)
    prompt = [(13 * j) % 400 + 20 for j in range(150)]
    first = engine.generate([greedy("t1", prompt, 40, to_limit=True)])["t1"]
    again = engine.generate([greedy("t1b", prompt, 40, to_limit=True)])["t1b"]
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == 144  # the prompt's last boundary
    assert again.token_ids == first.token_ids
    # The next turn: the conversation so far (prompt and reply) and a new question.
    turn2 = prompt + first.token_ids + [30, 31, 32, 33, 34]
    resumed = engine.generate([greedy("t2", turn2, 16, to_limit=True)])["t2"]
    fresh = fresh_engine.generate([greedy("t2f", turn2, 16, to_limit=True)])["t2f"]
    assert resumed.token_ids == fresh.token_ids
    assert resumed.stats.cached_tokens == (len(prompt) + len(first.token_ids) - 1) // 16 * 16  # the reply's end
    assert resumed.stats.cached_tokens >= 0.9 * len(turn2)


def test_a_prompt_sharing_part_of_a_one_step_prompt_resumes_at_its_last_interval_snapshot(checkpoint) -> None:
    engine = _engine(checkpoint, prefill_chunk_size=512, state_snapshot_tokens=48)
    shared = [(13 * j) % 400 + 20 for j in range(150)]
    engine.generate([greedy("long", shared + [7] * 30, 4, to_limit=True)])  # one prompt pass of 180 tokens
    branch = shared + [9] * 20  # parts from the first prompt after 150 tokens
    resumed = engine.generate([greedy("b", branch, 16, to_limit=True)])["b"]
    fresh = _engine(checkpoint, prompt_cache_gib=0).generate([greedy("f", branch, 16, to_limit=True)])["f"]
    assert resumed.stats.cached_tokens == 144  # the snapshot at 3 x 48 inside the first prompt's one pass
    assert resumed.token_ids == fresh.token_ids


def test_preempted_request_equals_uninterrupted(checkpoint) -> None:
    prompts = _prompts(6)
    roomy = _engine(checkpoint).generate(_requests(prompts, "p", max_tokens=40))
    probe = _engine(checkpoint)
    block_bytes = probe.runner_info.kv_bytes_per_token * 16
    state_bytes = probe.runner_info.state_bytes_per_slot * 2 * 6
    # No snapshots (prompt_cache_gib 0): the budget is six lanes' slots and 12 blocks of 16 tokens, too few
    # for six replies growing to ~80 tokens, so later ones get preempted.
    budget = (12.5 * block_bytes + state_bytes) / 2**30
    tight_engine = _engine(checkpoint, kv_cache_gib=budget, parallel=6, prompt_cache_gib=0)
    assert tight_engine.blocks.num_blocks == 12
    tight = tight_engine.generate(_requests(prompts, "p", max_tokens=40))
    assert tight_engine.counters.preemptions_total > 0
    assert reply_tokens(roomy, "p", 6) == reply_tokens(tight, "p", 6)


def test_drafted_replies_equal_serial_ones(checkpoint) -> None:
    """A grammar makes a random model's reply repeat, so n-gram lookup proposes drafts: all kept when the
    draw is greedy, some rejected when it samples (each rejection resumes from the last kept row's states)."""
    engine = _engine(checkpoint, draft="ngram", draft_policy="fixed", draft_tokens=3)
    prompt = [40, 41, 42, 43, 44]
    requests = [
        greedy("kept", prompt, 30, grammar=GrammarSpec("regex", "(ab){12}")),
        EngineRequest(
            "mixed",
            prompt,
            SamplingParams(temperature=1.0, seed=4),
            max_tokens=30,
            grammar=GrammarSpec("regex", "[ab]{24}"),
        ),
        EngineRequest("free", prompt[1:], SamplingParams(temperature=0.7, seed=9, ignore_eos=True), max_tokens=30),
    ]
    drafted = engine.generate(requests)
    serial = engine.generate([replace(r, request_id=r.request_id + "-serial", draft=False) for r in requests])
    for request in requests:
        assert drafted[request.request_id].token_ids == serial[request.request_id + "-serial"].token_ids
    kept, mixed = drafted["kept"].stats, drafted["mixed"].stats
    assert kept.drafted > 0 and kept.accepted == kept.drafted
    assert mixed.drafted > mixed.accepted > 0


def test_snapshots_stay_under_a_small_cap_and_replies_stay_exact(checkpoint) -> None:
    probe = _engine(checkpoint)
    cap = 2.5 * probe.runner_info.state_bytes_per_slot / 2**30  # room for two snapshots
    engine = _engine(checkpoint, prompt_cache_gib=cap)
    assert engine.states is not None and engine.states.max_snapshots == 2
    prompts = _prompts(8)[4:8]
    first = engine.generate(_requests(prompts, "a"))
    assert len(engine.states.snapshots) <= 2
    again = engine.generate(_requests(prompts, "b"))
    assert reply_tokens(first, "a", 4) == reply_tokens(again, "b", 4)


def _case_arch(case) -> str:
    return (case.values[0] if hasattr(case, "values") else case)[0]


# Only Nemotron-H drafts with its MTP step (the Qwen hybrids' MTP weights are not read).
MTP_CASES = [case for case in CASES if _case_arch(case) == "nemotron_h"]


@pytest.mark.parametrize("checkpoint", MTP_CASES, indirect=True, ids=lambda case: "-".join(case))
def test_mtp_drafted_replies_equal_serial_ones(checkpoint) -> None:
    """Each verify round captures the states after its rows, so MTP-drafted replies equal `draft: false`
    ones, kept drafts or not."""
    engine = _engine(checkpoint, draft="auto", draft_policy="fixed", draft_tokens=2)
    assert engine.runner_info.mtp
    requests = _requests(_prompts(4), "m", max_tokens=24)
    drafted = engine.generate(requests)
    serial = engine.generate([replace(r, request_id=r.request_id + "-serial", draft=False) for r in requests])
    for request in requests:
        assert drafted[request.request_id].token_ids == serial[request.request_id + "-serial"].token_ids
    assert sum(drafted[r.request_id].stats.drafted for r in requests) > 0
