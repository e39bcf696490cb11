"""Drafted replies equal `draft: false` replies token for token: MTP and n-gram, float32 and bfloat16.

Every request runs twice on one engine, drafted and as the serial reference, in concurrent batches; the
ids, text, finish reason, logprob rows and usage must match exactly. Each case also checks that drafts were
verified (and, where the drafter is good, kept and rejected), so the comparison covers the verify path.
The MTP cases run on the torch rank and on the MLX rank (where mlx imports).
"""

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams, ThinkingControls
from deployments.scheduler.engine.completion import Completion
from deployments.scheduler.engine.core import Engine
from serve_app.args import resolve_model_dir

SAMPLINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=12),
    SamplingParams(temperature=0.7, min_p=0.05, seed=13),
]


@pytest.fixture(scope="module")
def tiny_glm() -> str:
    return str(resolve_model_dir("builtin:tiny-glm"))


@pytest.fixture(scope="module")
def corpus_prompts(tiny_glm: str) -> list[list[int]]:
    from deployments.tokenizer import load_tokenizer
    from serve_app.fixtures.tiny_glm import TEMPLATE_PATH
    from serve_app.fixtures.tiny_glm.data import corpus_examples

    tokenizer = load_tokenizer(tiny_glm)
    return [tokenizer.encode(e.prompt) for e in corpus_examples(Path(TEMPLATE_PATH).read_text())]


NO_MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
BACKENDS = ["torch", pytest.param("mlx", marks=NO_MLX)]


def _engine(model: str, dtype: str, draft: str, backend: str = "torch", **overrides) -> Engine:
    # Fixed lengths: the draft counts asserted below do not depend on measured step times.
    settings = dict(
        model=model,
        dtype=dtype,
        kv_cache_gib=0.02,
        parallel=32,
        prefill_chunk_size=64,
        draft=draft,
        draft_policy="fixed",
        backend=backend,
    )
    if backend == "torch":
        settings["engine_threads"] = 1  # MLX sizes its own threads
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def _both(engine: Engine, requests: list[EngineRequest]) -> tuple[dict[str, Completion], dict[str, Completion]]:
    """The requests drafted, then as the serial reference (both batches concurrent)."""
    drafted = engine.generate([replace(r, request_id=f"d-{r.request_id}", draft=True) for r in requests])
    serial = engine.generate([replace(r, request_id=f"s-{r.request_id}", draft=False) for r in requests])
    return drafted, serial


def _assert_equal(drafted: dict[str, Completion], serial: dict[str, Completion]) -> tuple[int, int]:
    """Reply by reply equality; returns (drafted, accepted) over the drafted replies."""
    totals = [0, 0]
    for key, reply in serial.items():
        twin = drafted["d-" + key.removeprefix("s-")]
        assert twin.token_ids == reply.token_ids, key
        assert (twin.text, twin.finish_reason) == (reply.text, reply.finish_reason), key
        assert twin.stats.completion_tokens == reply.stats.completion_tokens, key
        assert reply.stats.drafted == 0 and reply.stats.draft_method == "off", key
        totals[0] += twin.stats.drafted
        totals[1] += twin.stats.accepted
    return totals[0], totals[1]


def _requests(prompts: list[list[int]], tag: str, **fields) -> list[EngineRequest]:
    return [
        EngineRequest(f"{tag}{i}-{j}", p, sampling=replace(s), **fields)
        for i, p in enumerate(prompts)
        for j, s in enumerate(SAMPLINGS)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_drafts_equal_serial_replies(
    tiny_glm: str, corpus_prompts: list[list[int]], dtype: str, backend: str
) -> None:
    engine = _engine(tiny_glm, dtype, "mtp", backend)
    assert engine.draft_method == "mtp"
    requests = _requests(corpus_prompts[::2], "m", max_tokens=40)  # 16 prompts x 4 samplings
    drafted, kept = _assert_equal(*_both(engine, requests))
    assert kept > 0.8 * drafted > 0  # the trained MTP layer guesses the corpus replies
    info = engine.info()
    assert info.counters.drafted_total == drafted and info.counters.accepted_total == kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_drafts_equal_serial_replies(tiny_glm: str, corpus_prompts: list[list[int]], dtype: str) -> None:
    engine = _engine(tiny_glm, dtype, "ngram")
    assert engine.draft_method == "ngram"
    # A reply that repeats text of its prompt: the scripted prompt, its reply, and the prompt again.
    greedy = engine.generate(
        [
            EngineRequest(f"g{i}", p, max_tokens=40, draft=False, sampling=SamplingParams(temperature=0.0))
            for i, p in enumerate(corpus_prompts[:8])
        ]
    )
    copying = [p + greedy[f"g{i}"].token_ids + p for i, p in enumerate(corpus_prompts[:8])]
    requests = _requests(copying, "n", max_tokens=40)
    drafted, kept = _assert_equal(*_both(engine, requests))
    assert drafted > kept > 0  # drafts were kept and rejected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_on_a_random_qwen3_equals_serial(tmp_path_factory: pytest.TempPathFactory, dtype: str) -> None:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    out = tmp_path_factory.mktemp(f"qwen3-drafts-{dtype}")
    build_random_checkpoint("qwen3", out, seed=5, dtype=dtype)
    build_tokenizer(out, family="qwen")
    engine = _engine(str(out), dtype, "auto")
    assert engine.draft_method == "ngram"  # no MTP layer: auto looks up n-grams
    prompts = [[20 + (i * 7 + j % (3 + i)) % 200 for j in range(40 + 4 * i)] for i in range(6)]  # repetitive
    requests = [
        replace(r, sampling=replace(r.sampling, ignore_eos=True)) for r in _requests(prompts, "q", max_tokens=32)
    ]
    drafted, _ = _assert_equal(*_both(engine, requests))
    assert drafted > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuts_and_constraints_equal_serial(tiny_glm: str, corpus_prompts: list[list[int]], backend: str) -> None:
    """Stop strings, end tokens ignored, limits, grammars (a forced tool call too), a thinking budget and
    logprobs cut drafts the same."""
    engine = _engine(tiny_glm, "float32", "mtp", backend)
    tokenizer = engine.tokenizer
    prompts = corpus_prompts[::3]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    from deployments.chat_format.forced_calls import forced_call_ebnf
    from deployments.chat_format.markups import GLM
    from serve_app.fixtures.tiny_glm.corpus import TOOLS

    think_open, think_close = tokenizer.encode("<think>"), tokenizer.encode("</think>")
    forced = GrammarSpec(
        "ebnf",
        forced_call_ebnf(TOOLS, GLM, parallel=True),
        think_opener_id=think_open[0],
        think_closer_id=think_close[0],
        param="tool_choice",
    )
    thinking = ThinkingControls(
        opener_id=think_open[0], closer_id=think_close[0], budget=6, close_ids=tokenizer.encode("\n</think>\n\n")
    )
    requests: list[EngineRequest] = []
    for i, prompt in enumerate(prompts):
        greedy = SamplingParams(temperature=0.0)
        requests += [
            EngineRequest(f"stop{i}", prompt, sampling=replace(greedy, stop=["a", "e "]), max_tokens=40),
            EngineRequest(f"eos{i}", prompt, sampling=replace(greedy, ignore_eos=True), max_tokens=30),
            EngineRequest(f"short{i}", prompt, sampling=greedy, max_tokens=1 + i % 3),
            EngineRequest(
                f"json{i}",
                prompt,
                sampling=SamplingParams(temperature=0.9, seed=i),
                max_tokens=48,
                grammar=GrammarSpec("json_schema", json.dumps(schema)),
            ),
            EngineRequest(
                f"regex{i}",
                prompt,
                sampling=greedy,
                max_tokens=24,
                grammar=GrammarSpec("regex", r"(Paris|Red|[0-9]+)[.!]"),
            ),
            EngineRequest(f"think{i}", prompt, sampling=greedy, max_tokens=40, thinking=thinking),
            EngineRequest(
                f"tool{i}", prompt, sampling=SamplingParams(temperature=0.6, seed=i), max_tokens=60, grammar=forced
            ),
            EngineRequest(
                f"logprobs{i}", prompt, sampling=SamplingParams(temperature=0.8, seed=i), max_tokens=24, logprobs=3
            ),
        ]
    drafted, serial = _both(engine, requests)
    total, kept = _assert_equal(drafted, serial)
    assert total > kept > 0
    for key, reply in serial.items():
        twin = drafted["d-" + key.removeprefix("s-")]
        assert twin.stats.stop_string == reply.stats.stop_string, key
        if key.startswith("s-logprobs"):
            assert twin.logprobs == reply.logprobs and len(reply.logprobs) == len(reply.token_ids), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_preempted_drafted_replies_equal_serial(tiny_glm: str, corpus_prompts: list[list[int]], backend: str) -> None:
    """A pool too small for every reply at once: drafted sequences are preempted, recomputed, and still equal."""
    block_bytes = _engine(tiny_glm, "float32", "mtp", backend).runner_info.kv_bytes_per_token * 16
    engine = _engine(
        tiny_glm, "float32", "mtp", backend, kv_cache_gib=40.5 * block_bytes / 2**30, parallel=16, prefill_chunk_size=32
    )
    assert engine.blocks.num_blocks == 40
    requests = [
        EngineRequest(f"p{i}", p, sampling=SamplingParams(temperature=0.0, ignore_eos=True), max_tokens=60)
        for i, p in enumerate(corpus_prompts[:12])
    ]
    drafted, serial = _both(engine, requests)
    _assert_equal(drafted, serial)
    assert sum(r.stats.preemptions for r in drafted.values()) > 0
    solo = engine.generate([replace(requests[0], request_id="solo")])["solo"]
    assert solo.token_ids == serial["s-p0"].token_ids


def test_measured_draft_lengths_keep_replies_equal(tiny_glm: str, corpus_prompts: list[list[int]]) -> None:
    """The cost model picks lengths from step times (so counts vary run to run); replies never do."""
    engine = _engine(tiny_glm, "float32", "mtp", draft_policy="measured")
    _assert_equal(*_both(engine, _requests(corpus_prompts[1::4], "t", max_tokens=32)))
