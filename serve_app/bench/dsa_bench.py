"""`tensorfold bench dsa`: what DeepSeek sparse attention buys at long context, side by side in one run.

The same GLM-5.3-Flash-shaped checkpoint runs twice on fresh engines: as it is (each query reads its indexer's
`index_topk` tokens) and as a dense twin (the same weights, `index_topk` past the context, so every query reads
every earlier token through the same code). Each decodes after one long prompt; the table gives decode tok/s,
ms per decode step, and the prompt's prefill tok/s, then the sparse-to-dense ratios.
"""

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.scheduler.engine.core import Engine
from serve_app.bench.workload import StepTally, bench_checkpoint, bench_requests, random_prompts


@dataclass
class Figures:
    prefill_tps: float
    decode_tps: float
    step_ms: float


def dense_twin(checkpoint: Path, out: Path, context: int) -> Path:
    """A folder with the checkpoint's files linked and its config's `index_topk` past `context` (every
    token kept), a multiple of `index_kpool` as the k-pool indexer needs."""
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    pool = int(text.get("index_kpool", 1))
    text["index_topk"] = (context // pool + 1) * pool
    (out / "config.json").write_text(json.dumps(config))
    return out


def _figures(checkpoint: Path, prompt: list[int], decode_tokens: int, args: argparse.Namespace) -> Figures:
    window = len(prompt) + decode_tokens + 64
    config = EngineConfig(
        model=str(checkpoint),
        dtype=args.dtype,
        context=window,
        parallel=1,
        kv_cache_gib=2.0,
        draft="off",
        engine_threads=torch.get_num_threads(),
        prefill_chunk_size=2048,
    )
    engine = Engine(config)
    try:
        engine.generate(bench_requests([prompt[:64]], 4))  # warm-up
        tally = StepTally()
        engine.generate(bench_requests([prompt], decode_tokens), on_step=tally)
    finally:
        engine.shutdown()
    steps = max(tally.steps["decode"], 1)
    return Figures(
        len(prompt) / tally.seconds["prefill"],
        tally.tokens["decode"] / tally.seconds["decode"],
        1000 * tally.seconds["decode"] / steps,
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="tensorfold-dsa-") as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(scratch), args.size)
        dense = dense_twin(checkpoint, Path(scratch) / "dense", args.context)
        vocab = json.loads((checkpoint / "config.json").read_text()).get("text_config", {}).get("vocab_size", 32000)
        prompt = random_prompts(1, args.context, vocab)[0]
        sparse_figures = _figures(checkpoint, prompt, args.decode_tokens, args)
        dense_figures = _figures(dense, prompt, args.decode_tokens, args)
    print(f"checkpoint: {checkpoint.name}  context {args.context}  threads {torch.get_num_threads()}")
    print(f"{'figure':<34} {'sparse':>10} {'dense':>10} {'ratio':>8}")
    rows = (
        ("decode tok/s after the prompt", sparse_figures.decode_tps, dense_figures.decode_tps, True),
        ("ms per decode step", sparse_figures.step_ms, dense_figures.step_ms, False),
        (f"prefill tok/s ({args.context} tokens)", sparse_figures.prefill_tps, dense_figures.prefill_tps, True),
    )
    for name, ours, theirs, higher in rows:
        ratio = ours / theirs if higher else theirs / ours
        print(f"{name:<34} {ours:>10.1f} {theirs:>10.1f} {ratio:>7.2f}x")
    return 0
