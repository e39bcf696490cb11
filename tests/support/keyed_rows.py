"""Rows and draws the keyed sampler's tests share: flat, peaked, tied, masked, bfloat16-rounded and wide
logits of any vocabulary, and settings that reach every cut's edge."""

import torch

from deployments.messages.step import SeqDraw

SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.5, top_p=0.95, top_k=50),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=1.0, top_k=3000),
    dict(temperature=0.8, top_p=1e-9),
    dict(temperature=0.8, top_k=1),
    dict(temperature=0.9, min_p=0.999999),
    dict(temperature=2.0, top_p=0.5, min_p=0.1, top_k=20),
    dict(temperature=0.8, top_p=0.95, top_k=40),
]


def logit_rows(vocab: int, seed: int) -> torch.Tensor:
    """Flat, peaked, tied, masked, bfloat16-rounded and wide rows of one vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(vocab, generator=gen)
    peaked = torch.randn(vocab, generator=gen) * 2 - 4
    peaked[torch.randperm(vocab, generator=gen)[:24]] += torch.linspace(14, 8, 24)
    tied = torch.randn(vocab, generator=gen)
    tied[7:12] = tied.max() + 1  # five likeliest tokens, one value
    masked = torch.randn(vocab, generator=gen) * 3
    masked[vocab // 10 : vocab // 2] = float("-inf")
    bf16 = (torch.randn(vocab, generator=gen) * 4).bfloat16().float()  # ties everywhere
    wide = torch.randn(vocab, generator=gen) * 8
    head = torch.full((vocab,), float("-inf"))
    head[: min(30, vocab)] = torch.randn(min(30, vocab), generator=gen) + 9  # a grammar's few tokens
    return torch.stack([flat, peaked, tied, masked, bf16, wide, head])


def keyed_draws(count: int, settings: dict, seed: int, **extra: object) -> list[SeqDraw]:
    base: dict = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    base.update(settings)
    return [SeqDraw(seed=seed * 1000 + row, reply_position=seed + 3 * row, **base, **extra) for row in range(count)]
