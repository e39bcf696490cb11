"""`tensorfold bench snapshots`: what `state_snapshot_tokens` buys a hybrid model, side by side in one run.

A recurrent layer resumes a cached prefix only from a state snapshot, so prompts that share a long prefix
and then part (one system prompt, many questions) resume from the last snapshot inside the shared part and
recompute the rest. For each interval the same workload runs on a fresh engine: one prompt of the shared
prefix and its own question computes everything, then R more prompts share that prefix with questions of
their own. The table shows, over those R, the prompt tokens recomputed and their prefill time, and what
the cache holds afterwards: snapshots, their memory, and the KV memory of the cached prompt blocks.
"""

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.scheduler.engine.core import Engine
from serve_app.bench.workload import StepTally, bench_checkpoint, bench_requests, random_prompts

MIB = 1 << 20


@dataclass
class IntervalFigures:
    interval: int
    recomputed: float  # mean prompt tokens computed per later request (prompt - cached)
    prefill_seconds: float  # mean prefill time per later request
    snapshots: int  # held in the cache after the workload
    snapshot_mib: float
    kv_mib: float  # the cached prompt blocks' KV, for scale


def _interval_figures(config: EngineConfig, prompts: list[list[int]]) -> IntervalFigures:
    engine = Engine(config)
    assert engine.states is not None, "snapshot intervals only matter for hybrid models"
    engine.generate(bench_requests(prompts[:1], 1))  # the first prompt computes the shared prefix
    recomputed, seconds = [], []
    for prompt in prompts[1:]:
        tally = StepTally()
        (done,) = engine.generate(bench_requests([prompt], 1), on_step=tally).values()
        assert done.stats is not None
        recomputed.append(done.stats.prompt_tokens - done.stats.cached_tokens)
        seconds.append(tally.seconds["prefill"])
    info, states = engine.runner_info, engine.states
    held = len(states.snapshots)
    kv_bytes = info.kv_bytes_per_token * len(engine.blocks.by_hash) * config.block_size
    return IntervalFigures(
        config.state_snapshot_tokens,
        sum(recomputed) / len(recomputed),
        sum(seconds) / len(seconds),
        held,
        held * info.state_bytes_per_slot / MIB,
        kv_bytes / MIB,
    )


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """One shared prefix and `requests + 1` distinct questions after it."""
    prefix = random_prompts(1, args.shared_tokens, vocab)[0]
    questions = random_prompts(args.requests + 2, args.question_tokens + 1, vocab)[1:]
    return [prefix + q for q in questions[: args.requests + 1]]


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="tensorfold-bench-") as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(scratch), args.size)
        base = EngineConfig(
            model=str(checkpoint),
            dtype=args.dtype,
            device="cpu",
            context=args.context,
            engine_threads=torch.get_num_threads(),
        )
        vocab = _vocab(checkpoint)
        prompts = _prompts(args, vocab)
        rows = [
            _interval_figures(base.model_copy(update={"state_snapshot_tokens": every}), prompts) for every in args.every
        ]
    _print_table(args, rows)
    return 0


def _vocab(checkpoint: Path) -> int:
    import json

    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


def _print_table(args: argparse.Namespace, rows: list[IntervalFigures]) -> None:
    print(f"state snapshot: {rows[0].snapshot_mib / max(rows[0].snapshots, 1):.1f} MiB each")
    print(
        f"shared prefix {args.shared_tokens} tokens, then {args.requests} prompts with {args.question_tokens}-token "
        f"questions of their own (one warm-up prompt first); torch threads {torch.get_num_threads()}"
    )
    print(f"{'interval':>9} {'recomputed':>11} {'prefill s':>10} {'snapshots':>10} {'snap MiB':>9} {'KV MiB':>8}")
    for row in rows:
        print(
            f"{row.interval:>9} {row.recomputed:>11.0f} {row.prefill_seconds:>10.3f} {row.snapshots:>10} "
            f"{row.snapshot_mib:>9.1f} {row.kv_mib:>8.1f}"
        )
