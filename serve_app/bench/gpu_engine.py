"""The engine phase of `python -m kernels.gpu_check`: the offline engine end to end on one device, no Ray.

It builds a random Qwen3-shaped checkpoint offline (`--size 1b`: Qwen3-1.7B's layer, 20 layers and a tied
32k vocabulary, ~1.07B parameters; `tiny`: the tests' 2-layer model, seconds on a CPU), then checks and times:

1. parity: each prompt's greedy first token against transformers' on the same device, in float32 and in
   bfloat16. A different token passes only as a near tie: transformers' float32 logits of the two tokens
   closer than TIE x the row's largest |logit|;
2. exactness: each of 16 prompts' reply alone equals its reply batched with the fifteen others, token for
   token (greedy and sampled replies side by side: even prompts greedy, odd ones sampled);
3. warm-up: the engine's load and its first request's seconds (Triton compiles its kernels then);
4. speed: decode tokens/s, greedy and sampled, of one stream and of 16;
and, on CUDA, 2 and 4 again with `cuda_matmul: cublas`, for contrast (not judged).
It prints one summary line and exits 1 when parity or exactness fails (docs/benchmarks.md, The GPU check).
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.scheduler.engine.core import Engine
from serve_app.bench.workload import StepTally, random_prompts

# Qwen3-1.7B's decoder layer (hidden 2048, MLP 6144, 16 query and 8 KV heads of 128) x 20, a tied 32k embedding.
QWEN3_1B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
)
# Near-tie margins, relative to the row's largest |logit|: about what each dtype's rounding over the layers
# moves a logit by (two implementations may then pick either of two tokens that close).
TIE = {"float32": 1e-4, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Plan:
    """How much work each part does at one size."""

    prompts: int  # parity and exactness prompts; the 16-stream speed runs take as many
    prompt_tokens: tuple[int, int]  # the shortest and the longest prompt
    reply_tokens: int  # each exactness reply
    speed_tokens: int  # decode tokens per stream in a speed run
    kv_cache_gib: float


PLANS = {"1b": Plan(16, (32, 256), 32, 128, 4.0), "tiny": Plan(16, (8, 40), 4, 4, 0.05)}


@dataclass
class EnginePass:
    """One engine's figures (one dtype, one matmul)."""

    load_s: float = 0.0
    warmup_s: float = 0.0
    first_tokens: list[int] = field(default_factory=list)
    same: dict[str, int] = field(default_factory=dict)  # "greedy", "sampled": replies alone == batched
    rates: dict[str, float] = field(default_factory=dict)  # "greedy 1", "greedy 16", "sampled 1", ...
    params: float = 0.0
    device_name: str = ""


def build_checkpoint(out: Path, size: str) -> Path:
    """The random checkpoint (bf16 at 1b, float32 tiny) with a small trained Qwen-family tokenizer."""
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer, use_tokenizer_end_token

    if size == "1b":
        build_random_checkpoint("qwen3", out, size="bench", dtype="bfloat16", vocab_size=32768, **QWEN3_1B)
    else:
        build_random_checkpoint("qwen3", out, seed=3)
    build_tokenizer(out, family="qwen")
    return use_tokenizer_end_token(out)


def make_prompts(plan: Plan, vocab: int) -> list[list[int]]:
    """Prompts of lengths spread over the plan's range (so a batch mixes them), seeded."""
    shortest, longest = plan.prompt_tokens
    spread = longest - shortest + 1
    drawn = random_prompts(plan.prompts, longest, vocab)
    return [prompt[: shortest + (37 * i) % spread] for i, prompt in enumerate(drawn)]


def reference_logits(checkpoint: Path, prompts: list[list[int]], dtype: str, device: str) -> list[torch.Tensor]:
    """transformers' logits at each prompt's last position, [V] float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.inference_mode():
        rows = [model(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
    del model
    release(device)
    return rows


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def request(prompt: list[int], index: int, tag: str, max_tokens: int, sampled: bool) -> EngineRequest:
    """Prompt `index`'s request: greedy, or sampled with its own seed (the same alone and batched)."""
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + index, ignore_eos=True)
    if not sampled:
        sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id=f"{tag}-{index}", prompt_token_ids=prompt, sampling=sampling, max_tokens=max_tokens)


def first_tokens(engine: Engine, prompts: list[list[int]]) -> list[int]:
    """Each prompt's greedy first token, the prompts batched in one `generate` call."""
    batch = [request(p, i, "first", 1, sampled=False) for i, p in enumerate(prompts)]
    done = engine.generate(batch)
    return [done[r.request_id].token_ids[0] for r in batch]


def count_same(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, int]:
    """How many replies alone equal the same replies batched with all the others, greedy (even prompts) and
    sampled (odd ones) side by side."""
    batch = [request(p, i, "batched", max_tokens, sampled=i % 2 == 1) for i, p in enumerate(prompts)]
    together = engine.generate(batch)
    same = {"greedy": 0, "sampled": 0}
    for i, shared in enumerate(batch):
        alone = engine.generate([request(prompts[i], i, "alone", max_tokens, sampled=i % 2 == 1)])[f"alone-{i}"]
        tokens = together[shared.request_id].token_ids
        same["sampled" if i % 2 else "greedy"] += tokens == alone.token_ids and len(tokens) == max_tokens
    return same


def decode_rate(engine: Engine, prompts: list[list[int]], tokens: int, sampled: bool) -> float:
    """Decode tokens/s of the prompts as streams of one `generate` call."""
    tally = StepTally()
    engine.generate([request(p, i, "speed", tokens, sampled) for i, p in enumerate(prompts)], on_step=tally)
    return tally.tokens["decode"] / max(tally.seconds["decode"], 1e-9)


def open_engine(checkpoint: Path, dtype: str, device: str, plan: Plan, matmul: str) -> Engine:
    config = EngineConfig(
        model=str(checkpoint),
        dtype=dtype,
        device=device,
        cuda_matmul=matmul,
        kv_cache_gib=plan.kv_cache_gib,
        parallel=plan.prompts,
        prompt_cache_gib=0,  # no reuse across requests: a batched reply computes what its alone twin did
        draft="off",
    )
    return Engine(config)


def run_engine(
    checkpoint: Path, dtype: str, device: str, plan: Plan, prompts: list[list[int]], matmul: str, full: bool
) -> EnginePass:
    """Load, warm up and take the first greedy tokens; with `full`, exactness and speed too."""
    figures, start = EnginePass(), time.perf_counter()
    engine = open_engine(checkpoint, dtype, device, plan, matmul)
    figures.load_s, start = time.perf_counter() - start, time.perf_counter()
    engine.generate([request(prompts[0][:16], 0, "warm-up", 4, sampled=False)])
    figures.warmup_s = time.perf_counter() - start
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    figures.params, figures.device_name = engine.runner_info.weight_bytes / element, engine.runner_info.device_name
    figures.first_tokens = first_tokens(engine, prompts)
    if full:
        figures.same = count_same(engine, prompts, plan.reply_tokens)
        for mode in ("greedy", "sampled"):
            for streams in (1, len(prompts)):
                rate = decode_rate(engine, prompts[:streams], plan.speed_tokens, mode == "sampled")
                figures.rates[f"{mode} {streams}"] = rate
    engine.shutdown()
    del engine
    release(device)
    return figures


def parity(ours: list[int], reference: list[torch.Tensor], referee: list[torch.Tensor], tie: float) -> tuple[int, int]:
    """(first tokens equal to the reference's, other ones that the float32 referee calls near ties)."""
    equal = ties = 0
    for token, row, judge in zip(ours, reference, referee):
        theirs = int(row.argmax())
        if token == theirs:
            equal += 1
        elif abs(float(judge[token] - judge[theirs])) <= tie * float(judge.abs().max()):
            ties += 1
    return equal, ties


def exact_and_fast(figures: EnginePass, prompts: int) -> str:
    halves = {"greedy": (prompts + 1) // 2, "sampled": prompts // 2}
    same = ", ".join(f"{mode} {figures.same[mode]}/{halves[mode]}" for mode in halves)
    rates = ", ".join(f"{name}: {rate:,.1f}" for name, rate in figures.rates.items())
    return f"alone = batched with {prompts - 1}: {same}; decode tok/s (streams) {rates}"


def summarize(
    passes: dict[str, EnginePass], cublas: EnginePass | None, reference: dict[str, list[torch.Tensor]], device: str
) -> tuple[bool, str]:
    """Whether the check passed, and its one line."""
    count, ok, parts = len(reference["float32"]), True, []
    for dtype, figures in passes.items():
        equal, ties = parity(figures.first_tokens, reference[dtype], reference["float32"], TIE[dtype])
        ok = ok and equal + ties == count
        parts.append(f"{dtype} {equal}/{count}" + (f" + {ties} near tie{'s' * (ties > 1)}" if ties else ""))
    main = passes["bfloat16"]
    ok = ok and sum(main.same.values()) == count
    line = [
        f"engine check {'PASS' if ok else 'FAILED'}",
        f"qwen3, {main.params / 1e6:,.1f}M parameters, on {main.device_name} ({device})",
        "first greedy tokens as transformers': " + ", ".join(parts),
        "bfloat16 " + exact_and_fast(main, count),
        f"load {main.load_s:.1f} s, warm-up {main.warmup_s:.1f} s",
    ]
    if cublas is not None:
        line.append("cuda_matmul cublas: " + exact_and_fast(cublas, count))
    return ok, " | ".join(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(PLANS), default="1b", help="the checkpoint: 1b, or tiny (CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu (with --size tiny)")
    plan = PLANS[args.size]
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the phase's output is its one line
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = build_checkpoint(Path(scratch) / f"qwen3-{args.size}", args.size)
        prompts = make_prompts(plan, json.loads((checkpoint / "config.json").read_text())["vocab_size"])
        reference = {dtype: reference_logits(checkpoint, prompts, dtype, args.device) for dtype in TIE}
        passes = {
            dtype: run_engine(checkpoint, dtype, args.device, plan, prompts, "invariant", full=dtype == "bfloat16")
            for dtype in TIE
        }
        cublas = None
        if args.device == "cuda":
            cublas = run_engine(checkpoint, "bfloat16", args.device, plan, prompts, "cublas", full=True)
    ok, line = summarize(passes, cublas, reference, args.device)
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
