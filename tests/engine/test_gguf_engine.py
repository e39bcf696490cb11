"""The engine's exactness on a GGUF model whose weights stay Q4_K / Q6_K blocks (docs/gguf.md): concurrent =
solo = chunked = cached = preempted = n-gram drafted, on the native CPU kernels."""

from dataclasses import replace
from pathlib import Path

import pytest

from deployments.config import EngineConfig
from deployments.gguf_files.folder import checkpoint_folder
from deployments.scheduler.engine.core import Engine
from kernels import quant_gemm
from tests.support.requests import alternating, reply_tokens

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="the native CPU kernels are off on this machine")
SHAPE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.gguf_writer import write_gguf
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    root = tmp_path_factory.mktemp("gguf-engine")
    checkpoint = build_random_checkpoint("qwen3", root / "qwen3", seed=3, **SHAPE)
    build_tokenizer(checkpoint, family="qwen")
    path = write_gguf(checkpoint, root / "qwen3-Q4_K_M.gguf", "Q4_K_M")[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TENSORFOLD_GGUF_CACHE", str(root / "cache"))
        return str(checkpoint_folder(Path(path)))


def _engine(folder: str, **overrides) -> Engine:
    settings = dict(model=folder, kv_cache_gib=0.02, parallel=8, prefill_chunk_size=64, draft="off")
    return Engine(EngineConfig(**{**settings, **overrides}))


def _requests(tag: str, count: int = 4, max_tokens: int = 16) -> list:
    # Each prompt repeats a cycle of 11 ids, so n-gram lookup finds its tail earlier and drafts from there.
    prompts = [[(7 * i + 13 * (j % 11)) % 400 + 20 for j in range(20 + 9 * i)] for i in range(count)]
    return alternating(prompts, tag, max_tokens, top_p=0.95, seed_base=500)


def test_replies_on_kept_blocks_are_exact_across_batching_chunking_caching_and_drafts(folder: str) -> None:
    engine = _engine(folder)
    assert engine.runner_info.weights_format.endswith("kept quantized") and "Q4_K" in engine.runner_info.weights_format
    together = reply_tokens(engine.generate(_requests("c")), "c", 4)
    solo = [engine.generate([r])[r.request_id].token_ids for r in _requests("s")]
    cached = engine.generate(_requests("c"))  # the prompts' full blocks are cached now
    chunked = _engine(folder, prefill_chunk_size=5).generate(_requests("c"))
    drafter = _engine(folder, draft="ngram", draft_policy="fixed")
    drafted = drafter.generate([replace(r, draft=True) for r in _requests("c")])
    assert together == solo == reply_tokens(cached, "c", 4) == reply_tokens(chunked, "c", 4)
    assert together == reply_tokens(drafted, "c", 4)
    assert cached["c-3"].stats.cached_tokens == 32 and sum(r.stats.drafted for r in drafted.values()) > 0


def test_a_preempted_reply_on_kept_blocks_equals_the_uninterrupted_one(folder: str) -> None:
    roomy = _engine(folder)
    block_bytes = roomy.runner_info.kv_bytes_per_token * 16
    tight = _engine(folder, kv_cache_gib=10.5 * block_bytes / 2**30, parallel=4)
    expected = roomy.generate(_requests("p", max_tokens=40))
    got = tight.generate(_requests("p", max_tokens=40))
    assert tight.counters.preemptions_total > 0
    assert reply_tokens(expected, "p", 4) == reply_tokens(got, "p", 4)
