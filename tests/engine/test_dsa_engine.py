"""DeepSeek-sparse-attention models in the engine (GLM-5.3 and GLM-5.3-Flash on tiny random checkpoints whose
indexers keep 32 tokens per query, prompts well past that): replies are the same solo and batched, whole and
chunked (chunks that split k-pools), fresh and resumed from the prefix cache (GLM-5.3-Flash: from KDA state
snapshots) or from disk, preempted or not, drafted or serial, in float32 and bfloat16; a conversation's next
turn finds its previous prompt and reply cached. On the torch rank and the MLX rank (where mlx imports)."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, GrammarSpec, ImprintQuery, SamplingParams
from deployments.prompt_store.links import LocalStoreLink
from deployments.scheduler.engine.core import Engine
from tests.support.requests import alternating, greedy, reply_tokens

ARCHS = ("glm_moe_dsa", "glm5_next")
NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
# bfloat16 on GLM-5.3-Flash only: its sparse MLA is GLM-5.3's, beside KDA and the streams' own rounding.
NAMED = [("glm_moe_dsa", "float32"), ("glm5_next", "float32"), ("glm5_next", "bfloat16")]
CASES = NAMED + [pytest.param((arch, "float32", "mlx"), marks=NO_MLX) for arch in ARCHS]
PROMPT = [(13 * j) % 400 + 20 for j in range(150)]  # the indexers select from the 33rd token on


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def checkpoint(request, tmp_path_factory) -> tuple[str, str, str]:
    from serve_app.fixtures.archs import tokenizer_family
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    arch, dtype, *backend = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
    build_random_checkpoint(arch, out, seed=5, dtype=dtype)
    build_tokenizer(out, family=tokenizer_family(arch))
    return str(out), dtype, backend[0] if backend else "torch"


def _engine(checkpoint: tuple[str, str, str], learn_dir: Path | None = None, **overrides: object) -> Engine:
    path, dtype, backend = checkpoint
    settings = dict(
        model=path, dtype=dtype, kv_cache_gib=0.02, parallel=16, prefill_chunk_size=64, draft="off", backend=backend
    )
    if learn_dir is not None:
        settings.update(learn_dir=str(learn_dir), learn_conversations=True)
    settings.update(overrides)
    config = EngineConfig(**settings)
    return Engine(config, None if learn_dir is None else LocalStoreLink(config))


def _prompts(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 400 + 20 for j in range(20 + 12 * i)] for i in range(count)]


def _requests(prompts: list[list[int]], tag: str, max_tokens: int = 24) -> list[EngineRequest]:
    return alternating(prompts, tag, max_tokens, top_p=0.9, seed_base=77)


def test_memory_counts_the_indexer_keys(checkpoint) -> None:
    """Each full indexer layer's rows (GLM-5.3: a 16-wide key in two layers, its MTP layer's only when it
    drafts; GLM-5.3-Flash: key and gate in one) are part of the KV pool, reported apart in /memory's ranks."""
    from deployments.scheduler.memory_report import replica_memory

    engine = _engine(checkpoint)
    path, dtype, _ = checkpoint
    full_layers, row = (2, 16) if "glm_moe_dsa" in path else (1, 32)  # the fixture's full layers, row width
    itemsize = 4 if dtype == "float32" else 2
    assert engine.runner_info.index_bytes_per_token == full_layers * row * itemsize
    rank = replica_memory("r", engine).ranks[0]
    assert 0 < rank.kv_index_bytes == full_layers * row * itemsize * 16 * engine.blocks.num_blocks < rank.kv_pool_bytes


def test_concurrent_equals_solo(checkpoint) -> None:
    prompts = _prompts(6)
    together = reply_tokens(_engine(checkpoint).generate(_requests(prompts, "c")), "c", 6)
    fresh = _engine(checkpoint, prompt_cache_gib=0)
    solo = [fresh.generate([r])[r.request_id].token_ids for r in _requests(prompts, "s")]
    assert together == solo and all(len(t) == 24 for t in together)


@pytest.mark.parametrize("chunk", [1, 23])
def test_chunked_prefill_equals_whole(checkpoint, chunk: int) -> None:
    prompts = _prompts(6)[3:6]  # 56 to 80 tokens: past the indexers' 32, chunks split 8-token pools
    whole = _engine(checkpoint, prefill_chunk_size=512).generate(_requests(prompts, "w"))
    chunked = _engine(checkpoint, prefill_chunk_size=chunk).generate(_requests(prompts, "w"))
    assert reply_tokens(whole, "w", 3) == reply_tokens(chunked, "w", 3)
    assert max(chunked["w-2"].stats.prefill_widths) <= chunk


def test_a_cached_prefix_equals_a_fresh_prompt_and_the_next_turn_finds_the_last_cached(checkpoint) -> None:
    engine = _engine(checkpoint)
    fresh_engine = _engine(checkpoint, prompt_cache_gib=0)
    first = engine.generate([greedy("t1", PROMPT, 40, to_limit=True)])["t1"]
    again = engine.generate([greedy("t1b", PROMPT, 40, to_limit=True)])["t1b"]
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == 144  # the prompt's last boundary
    assert again.token_ids == first.token_ids
    turn2 = PROMPT + first.token_ids + [30, 31, 32, 33, 34]
    resumed = engine.generate([greedy("t2", turn2, 16, to_limit=True)])["t2"]
    fresh = fresh_engine.generate([greedy("t2f", turn2, 16, to_limit=True)])["t2f"]
    assert resumed.token_ids == fresh.token_ids
    assert resumed.stats.cached_tokens >= 0.9 * len(turn2)


def test_preempted_request_equals_uninterrupted(checkpoint) -> None:
    prompts = _prompts(6)
    roomy = _engine(checkpoint).generate(_requests(prompts, "p", max_tokens=40))
    probe = _engine(checkpoint)
    block_bytes = probe.runner_info.kv_bytes_per_token * 16
    state_bytes = probe.runner_info.state_bytes_per_slot * 2 * 6  # GLM-5.3-Flash: six lanes' KDA slots
    # 14 blocks of 16 tokens, too few for six replies growing to 120 tokens: later ones get preempted.
    budget = (14.5 * block_bytes + state_bytes) / 2**30
    tight_engine = _engine(checkpoint, kv_cache_gib=budget, parallel=6, prompt_cache_gib=0)
    assert tight_engine.blocks.num_blocks == 14
    tight = tight_engine.generate(_requests(prompts, "p", max_tokens=40))
    assert tight_engine.counters.preemptions_total > 0
    assert reply_tokens(roomy, "p", 6) == reply_tokens(tight, "p", 6)


def test_drafted_replies_equal_serial_ones(checkpoint) -> None:
    """A grammar makes a random model's reply repeat, so n-gram lookup proposes drafts: all kept when the
    draw is greedy, some rejected when it samples; the verify rows are selected for like any query."""
    engine = _engine(checkpoint, draft="ngram", draft_policy="fixed", draft_tokens=3)
    prompt = PROMPT[:40]
    requests = [
        greedy("kept", prompt, 30, grammar=GrammarSpec("regex", "(ab){12}")),
        EngineRequest(
            "mixed",
            prompt,
            SamplingParams(temperature=1.0, seed=4),
            max_tokens=30,
            grammar=GrammarSpec("regex", "[ab]{24}"),
        ),
    ]
    drafted = engine.generate(requests)
    serial = engine.generate([replace(r, request_id=r.request_id + "-serial", draft=False) for r in requests])
    for request in requests:
        assert drafted[request.request_id].token_ids == serial[request.request_id + "-serial"].token_ids
    kept, mixed = drafted["kept"].stats, drafted["mixed"].stats
    assert kept.drafted > 0 and kept.accepted == kept.drafted
    assert mixed.drafted > mixed.accepted > 0


def test_mtp_drafts_equal_serial_ones(checkpoint) -> None:
    """GLM-5.3's MTP layer (with an indexer of its own over its own cache) drafts; its guesses are random
    here, so most are rejected, and every reply equals serial decoding, greedy and sampled."""
    path, _, _ = checkpoint
    if "glm_moe_dsa" not in path:
        pytest.skip("GLM-5.3-Flash's MTP layers are not read yet")
    engine = _engine(checkpoint, draft="mtp", draft_policy="fixed", draft_tokens=2)
    assert engine.draft_method == "mtp"
    requests = [greedy("g", PROMPT[:60], 24), *_requests(_prompts(3), "s")]
    drafted = engine.generate(requests)
    serial = engine.generate([replace(r, request_id=r.request_id + "-serial", draft=False) for r in requests])
    for request in requests:
        assert drafted[request.request_id].token_ids == serial[request.request_id + "-serial"].token_ids
    assert sum(reply.stats.drafted for reply in drafted.values()) > 0


def test_a_conversation_resumes_from_disk_exactly(checkpoint, tmp_path: Path) -> None:
    engine = _engine(checkpoint, tmp_path, parallel=4)
    reply = engine.generate([greedy("first", PROMPT, 12)])["first"].token_ids
    engine.disk.write_waiting()
    engine.shutdown()
    next_turn = PROMPT + reply + [40, 41, 42]
    restarted = _engine(checkpoint, tmp_path, parallel=4)  # a fresh RAM cache over the folder
    answer = restarted.imprint(ImprintQuery(next_turn))
    assert answer.resume_from == "disk" and answer.disk_tokens >= len(PROMPT) - 16
    resumed = restarted.generate([greedy("resumed", next_turn, 12)])["resumed"]
    assert resumed.stats.disk_tokens == answer.disk_tokens
    fresh = _engine(checkpoint).generate([greedy("fresh", next_turn, 12)])["fresh"]
    assert resumed.token_ids == fresh.token_ids and fresh.stats.cached_tokens == 0
