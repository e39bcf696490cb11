"""`tensorfold bench engine`: our engine against transformers' generate on one checkpoint, in one run.

Reports prefill tokens/s (the fastest of a few distinct prompts), decode tokens/s at 1 and N concurrent
requests (plain decode unless --draft, as generate runs; greedy unless --temperature), and batch-1 decode
as a fraction of the memory-bandwidth roofline (weight bytes read per token over a measured read
bandwidth). `--backend mlx` adds the MLX rank's column beside the torch rank's.
"""

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.model_rank.runner import RunnerInfo
from deployments.scheduler.engine.core import Engine
from kernels import cpu_native
from serve_app.bench.engine_profile import print_profile, profile_steps
from serve_app.bench.workload import StepTally, bench_checkpoint, bench_requests, random_prompts

PREFILL_SAMPLES = 3  # prefills of distinct prompts (no cache hits); the fastest is reported, as one step is noisy


@dataclass
class Figures:
    prefill_tps: float
    decode_tps_1: float
    decode_tps_n: float


def measure_read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s for streaming reads of a buffer larger than the caches (best of 5 sums)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _engine_figures(
    engine: Engine, prompts: list[list[int]], decode_tokens: int, concurrency: int, temperature: float
) -> Figures:
    def run(batch: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
        tally = StepTally()
        engine.generate(bench_requests(batch, max_tokens, temperature), on_step=tally)
        return tally.seconds["prefill"], tally.seconds["decode"], tally.tokens["decode"]

    run([prompts[0][:16]], decode_tokens)  # warm-up
    prefill = min(run([p], 1)[0] for p in prompts[1 : 1 + PREFILL_SAMPLES])
    _, decode, decoded = run([prompts[0]], decode_tokens)
    decode_1 = decoded / decode
    _, decode, decoded = run([p[:32] for p in prompts[:concurrency]], decode_tokens)
    return Figures(len(prompts[0]) / prefill, decode_1, decoded / decode)


def _transformers_figures(
    checkpoint: Path,
    dtype: torch.dtype,
    prompts: list[list[int]],
    decode_tokens: int,
    concurrency: int,
    temperature: float,
) -> Figures:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = "vision_config" in json.loads((checkpoint / "config.json").read_text())  # text-only input
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_pretrained(checkpoint, dtype=dtype)
    model.eval()
    # The same draw as ours: greedy, or the whole vocabulary at `temperature` (generate's top-k 50 off).
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}

    def generate(batch: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                **({"do_sample": False} | sampling),
            )
        return time.perf_counter() - start

    generate([prompts[0][:16]], 2)  # warm-up
    fastest = min(generate([p], 1) for p in prompts[1 : 1 + PREFILL_SAMPLES])
    prefill = generate([prompts[0]], 1)
    whole = generate([prompts[0]], decode_tokens)
    batch = [p[:32] for p in prompts[:concurrency]]
    batch_prefill = generate(batch, 1)
    batch_whole = generate(batch, decode_tokens)
    return Figures(
        prefill_tps=len(prompts[0]) / min(fastest, prefill),
        decode_tps_1=(decode_tokens - 1) / (whole - prefill),
        decode_tps_n=concurrency * (decode_tokens - 1) / (batch_whole - batch_prefill),
    )


def _engine_run(checkpoint: Path, backend: str, args: argparse.Namespace) -> tuple[Figures, RunnerInfo]:
    """One engine's figures on `checkpoint` (MLX sizes its own CPU threads; torch takes --threads)."""
    threads = torch.get_num_threads() if backend == "torch" else None
    engine = Engine(
        EngineConfig(
            model=str(checkpoint),
            dtype=args.dtype,
            kv_cache_gib=1.0,
            parallel=args.concurrency,
            engine_threads=threads,
            backend=backend,
            draft=args.draft,
        )
    )
    try:
        vocab = engine.runner_info.vocab_size
        prompts = random_prompts(max(args.concurrency, 1 + PREFILL_SAMPLES), args.prompt_tokens, vocab)
        figures = _engine_figures(engine, prompts, args.decode_tokens, args.concurrency, args.temperature)
        if args.profile and backend == "torch":
            _print_profile(engine, vocab, args.concurrency)
        return figures, engine.runner_info
    finally:
        engine.shutdown()


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)  # the engine and transformers alike
    backends = ["torch", "mlx"] if args.backend == "mlx" else ["torch"]  # MLX is measured beside torch
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(scratch), args.size)
        ours: dict[str, Figures] = {}
        for backend in backends:
            ours[backend], info = _engine_run(checkpoint, backend, args)
        weight_bytes, model_dtype = info.weight_bytes, getattr(torch, info.dtype)
        prompts = random_prompts(max(args.concurrency, 1 + PREFILL_SAMPLES), args.prompt_tokens, info.vocab_size)
        theirs = (
            None
            if args.skip_transformers
            else _transformers_figures(
                checkpoint, model_dtype, prompts, args.decode_tokens, args.concurrency, args.temperature
            )
        )
    bandwidth = measure_read_bandwidth()
    roofline = bandwidth / weight_bytes
    print(
        f"checkpoint: {checkpoint}  weights {weight_bytes / 1e6:.1f} MB ({model_dtype})  threads "
        f"{torch.get_num_threads()}  drafts {args.draft}  temperature {args.temperature}  "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s  "
        f"roofline {roofline:.1f} tok/s  CPU kernels {cpu_native.level_name()}  {torch_cpu_path()}"
    )
    _print_table(args, ours, theirs, roofline)
    return 0


def torch_cpu_path() -> str:
    """What transformers' (and torch's) CPU kernels run: ATen's vector level and whether bfloat16 GEMMs take
    oneDNN. On a CPU with AVX-512, `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` make torch take the path
    an AVX2-only CPU takes, so a forced `TENSORFOLD_KERNELS=avx2` run compares like with like."""
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"torch CPU {torch.backends.cpu.get_cpu_capability()} (oneDNN bf16 {'on' if onednn_bf16 else 'off'})"


def _print_table(args: argparse.Namespace, ours: dict[str, Figures], theirs: Figures | None, roofline: float) -> None:
    """One column per engine backend, then transformers, then each backend's ratio to transformers."""
    names = [f"tensorfold {b}" if len(ours) > 1 else "tensorfold" for b in ours]
    ratios = [f"{b}/hf" if len(ours) > 1 else "ratio" for b in ours]
    header = "".join(f" {n:>16}" for n in names) + f" {'transformers':>13}" + "".join(f" {r:>9}" for r in ratios)
    print(f"{'figure':34}{header}")
    fields = [
        (f"prefill tok/s ({args.prompt_tokens}-token prompt)", "prefill_tps"),
        ("decode tok/s, 1 request", "decode_tps_1"),
        (f"decode tok/s, {args.concurrency} concurrent", "decode_tps_n"),
    ]
    for label, field in fields:
        mine = [getattr(figures, field) for figures in ours.values()]
        other = getattr(theirs, field) if theirs else 0.0
        cells = "".join(f" {value:16.1f}" for value in mine) + (f" {other:13.1f}" if other else f" {'-':>13}")
        cells += "".join(f" {value / other:8.2f}x" if other else f" {'-':>9}" for value in mine)
        print(f"{label:34}{cells}")
    share = "".join(f" {figures.decode_tps_1 / roofline:16.0%}" for figures in ours.values())
    print(f"{'batch-1 decode / roofline':34}{share}")


def _print_profile(engine: Engine, vocab: int, concurrency: int) -> None:
    long_prompt = random_prompts(1, 512, vocab)
    short = random_prompts(concurrency, 32, vocab)
    rows = [
        ("decode, 1 seq", profile_steps(engine, short, "decode", 1, rounds=32)),
        (f"decode, {concurrency} seqs", profile_steps(engine, short, "decode", concurrency, rounds=16)),
        ("prefill, 512 tokens", profile_steps(engine, long_prompt, "prefill", 1, rounds=1)),
    ]
    print_profile(rows)
