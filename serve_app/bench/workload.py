"""What the in-process engine benchmarks share: a random checkpoint, random prompts, requests that write an
exact number of tokens, and the tally of step times an offline `Engine.generate` run reports."""

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deployments.messages.engine_process import Stepped
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams


def random_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` prompts of `length` ids drawn from the vocabulary (seeded: every run reads the same)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab - 10, (length,), generator=generator).tolist() for _ in range(count)]


def bench_requests(
    prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, grammar: GrammarSpec | None = None
) -> list[EngineRequest]:
    """One request per prompt that writes exactly `max_tokens` tokens: greedy, or sampled at `temperature`
    over the whole vocabulary (no top-k or top-p); under `grammar` if given."""
    return [
        EngineRequest(
            request_id=f"bench-{time.monotonic_ns()}-{i}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=temperature, seed=i, ignore_eos=True),
            max_tokens=max_tokens,
            grammar=grammar,
        )
        for i, prompt in enumerate(prompts)
    ]


@dataclass
class StepTally:
    """Steps, their seconds and the reply tokens they wrote, by kind ("prefill", "decode"): pass it as
    `Engine.generate`'s `on_step`."""

    steps: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    def __call__(self, stepped: Stepped) -> None:
        kind = stepped.step_kind
        if kind is None:
            return
        self.steps[kind] += 1
        self.seconds[kind] += stepped.step_seconds
        self.tokens[kind] += sum(len(chunk.token_ids) for chunk in stepped.chunks)


def bench_checkpoint(scratch: Path, size: str = "bench", dtype: str = "bfloat16") -> Path:
    """The random checkpoint a benchmark's `--size` names (bf16 by default), as `tensorfold fixture checkpoint`
    writes it (serve_app/fixtures/sized.py); "tiny" is the tests' Qwen3 with the benchmarks' 32k vocabulary."""
    from serve_app.fixtures.archs import SIZE_ARCHS
    from serve_app.fixtures.sized import WIDE_VOCAB, write_checkpoint

    arch = SIZE_ARCHS[size] or "qwen3"
    return write_checkpoint(scratch / f"{size}-{arch}", arch, size, dtype, vocab=WIDE_VOCAB)
