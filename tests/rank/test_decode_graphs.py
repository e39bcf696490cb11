"""Decode graphs' bookkeeping, run on CPU with the capture replaced by an eager replay (the CUDA capture itself
needs a GPU: `python -m kernels.gpu_check`): buckets, padding rows that change no real row, static buffers
reused every step, and the same tokens as the plain path, for a dense and a hybrid model and a whole engine."""

from pathlib import Path

import pytest
import torch

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.messages.step import ZERO_STATE, SeqDraw, SeqStep, StepPlan
from deployments.model_rank.decode_graphs import EagerReplay, buckets_for
from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.runner import ModelRunner
from deployments.model_rank.step_rows import step_rows
from deployments.model_rank.warm_up import warm_kernels
from deployments.scheduler.engine.core import Engine
from serve_app.fixtures.checkpoints import build_random_checkpoint
from serve_app.fixtures.tokenizer_builder import build_tokenizer

BLOCKS, SLOTS = 24, 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graphs")
    built = {arch: build_random_checkpoint(arch, root / arch) for arch in ("qwen3", "nemotron_h")}
    build_tokenizer(built["qwen3"], family="qwen")  # the engine test's
    return built


def _runner(checkpoint: Path, lanes: int | None) -> ModelRunner:
    """A bfloat16 runner; with `lanes`, its decode steps go through graphs for up to that many sequences."""
    runner = ModelRunner(checkpoint, "bfloat16", "cpu", ParallelContext())
    runner.allocate_kv(BLOCKS, 16, SLOTS if runner.state_specs else 0)
    for tensor in runner.caches:
        tensor.zero_()  # allocated uninitialised: the two runners' untouched slots would differ
    if lanes is not None:
        runner.warm_up(lanes, capture=EagerReplay())
    return runner


def _plan(seqs: list[tuple[int, list[int], int]], hybrid: bool) -> StepPlan:
    """(sequence, new tokens, tokens computed before): sequence i owns blocks 2i, 2i + 1 and state slot i."""
    draw = SeqDraw(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=1, reply_position=0)
    return StepPlan(
        "decode",
        [
            SeqStep(
                new_token_ids=tokens,
                num_computed=done,
                block_ids=[2 * index, 2 * index + 1],
                draw=draw,
                state_slot=index if hybrid else -1,
                state_from=ZERO_STATE if hybrid and not done else None,
            )
            for index, tokens, done in seqs
        ],
    )


def test_buckets_cover_every_batch_up_to_the_lanes() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(5) == [1, 2, 4, 5]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("arch", ["qwen3", "nemotron_h"])
def test_graph_steps_equal_plain_steps_bit_for_bit(arch: str, checkpoints: dict[str, Path]) -> None:
    plain, graphed = _runner(checkpoints[arch], None), _runner(checkpoints[arch], 8)
    assert graphed.graphs is not None and graphed.graphs.buckets == [1, 2, 4, 8]
    hybrid = bool(plain.state_specs)
    prompts = [[5 + 3 * i + j for j in range(4 + i)] for i in range(5)]
    prefill = _plan([(i, p, 0) for i, p in enumerate(prompts)], hybrid)
    assert not graphed.graphs.holds(step_rows(prefill, 16))  # prefill runs eagerly
    assert plain.execute(prefill).draws == graphed.execute(prefill).draws
    static = graphed.graphs.static
    computed = [len(p) for p in prompts]
    for step, sequences in enumerate([[0, 2, 4], [0, 1, 2, 3, 4], [3]]):  # buckets 4, 8 and 1
        plan = _plan([(i, [40 + step + i], computed[i]) for i in sequences], hybrid)
        rows = step_rows(plan, 16)
        assert graphed.graphs.holds(rows)
        (batch, hidden), (graph_batch, graph_hidden) = plain.forward(rows), graphed.forward(rows)
        bucket = graphed.graphs.bucket(len(sequences))
        assert graph_hidden.shape[0] == bucket == [4, 8, 1][step]  # the padding rows ran too
        assert torch.equal(graph_hidden[graph_batch.logits_indices], hidden[batch.logits_indices])
        assert graph_batch.input_ids.data_ptr() == static.longs.data_ptr()  # the graphs' buffers, every step
        assert graph_batch.paged[16].block_tables.data_ptr() == static.tables.data_ptr()
        for i in sequences:
            computed[i] += 1
    real = slice(0, BLOCKS)  # the sink is the block past them
    assert all(torch.equal(a[real], b[real]) for a, b in zip(plain.caches, graphed.caches))
    for ours, theirs in zip(plain.state_pools, graphed.state_pools):
        assert all(torch.equal(a[:SLOTS], b[:SLOTS]) for a, b in zip(ours, theirs))


def test_warm_up_writes_only_the_sink(checkpoints: dict[str, Path]) -> None:
    runner = _runner(checkpoints["nemotron_h"], None)
    for tensor in [*runner.caches, *(t for pool in runner.state_pools for t in pool)]:
        tensor.fill_(0.5)
    before = [t.clone() for t in runner.caches]
    warm_kernels(runner, lanes=4)
    assert all(torch.equal(a[:BLOCKS], b[:BLOCKS]) for a, b in zip(before, runner.caches))
    assert any(not torch.equal(a[BLOCKS], b[BLOCKS]) for a, b in zip(before, runner.caches))  # the sink's
    for pool in runner.state_pools:
        assert all(bool((t[:SLOTS] == 0.5).all()) and not t[SLOTS].any() for t in pool)  # sink zeroed after


def _requests(tag: str) -> list[EngineRequest]:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    prompts = [[11 + 7 * i + j for j in range(6 + 3 * i)] for i in range(5)]
    return [EngineRequest(f"{tag}{i}", p, sampling=sampling, max_tokens=6 + 2 * i) for i, p in enumerate(prompts)]


def test_an_engine_on_graphs_replies_as_without_them(checkpoints: dict[str, Path]) -> None:
    config = EngineConfig(
        model=str(checkpoints["qwen3"]), dtype="bfloat16", device="cpu", parallel=4, kv_cache_gib=0.01
    )
    plain, graphed = Engine(config), Engine(config)
    runner = graphed.executor.runner
    runner.warm_up(graphed.lanes, capture=EagerReplay())
    replayed: list[int] = []
    run = runner.graphs.run
    runner.graphs.run = lambda rows: (replayed.append(len(rows.query_lens)), run(rows))[1]
    want = {rid: c.token_ids for rid, c in plain.generate(_requests("r")).items()}
    got = {rid: c.token_ids for rid, c in graphed.generate(_requests("r")).items()}
    assert got == want and replayed and max(replayed) == 4  # five requests over four lanes
