"""A step's draws as device tensors, made before the forward pass so the draw itself waits on nothing.

Greedy and sampled rows are drawn apart; a sampled row's uniform is its key's (sampler.keyed_uniform),
computed on the host. Grammar rows send xgrammar's packed bitmask words (a mask that allows nothing is a
dead end and draws freely, as the matcher then refuses the token and ends that request).
"""

from dataclasses import dataclass

import torch

from deployments.messages.step import SeqDraw
from deployments.model_rank.host_reads import upload
from deployments.model_rank.keyed_draw import DrawSettings


@dataclass
class RowIndex:
    """Some of a step's rows: their positions on the host and on the device (None: all of them)."""

    rows: list[int]
    index: torch.Tensor | None


@dataclass
class GrammarRows:
    """The rows drawn under a grammar: their packed allowed-id words [Rc, W] (int32, on the device)."""

    rows: RowIndex
    words: torch.Tensor


@dataclass
class DrawInputs:
    draws: list[SeqDraw]
    greedy: RowIndex
    sampled: RowIndex
    settings: DrawSettings | None  # the sampled rows', in their order
    grammar: GrammarRows | None
    scored: RowIndex  # rows wanting logprobs or scores, drawn from the raw logits


def build_inputs(draws: list[SeqDraw], uniforms: list[float], device: torch.device) -> DrawInputs:
    """`uniforms`: each draw's keyed uniform (read by sampled rows only)."""
    greedy = [i for i, d in enumerate(draws) if d.temperature <= 0.0]
    sampled = [i for i, d in enumerate(draws) if d.temperature > 0.0]
    constrained = [i for i, d in enumerate(draws) if d.allowed is not None and bool(d.allowed.any())]
    scored = [i for i, d in enumerate(draws) if d.want_logprobs is not None or d.score_ids is not None]
    grammar = None
    if constrained:
        words = torch.stack([draws[i].allowed for i in constrained])  # type: ignore[misc]
        grammar = GrammarRows(_row_index(constrained, len(draws), device), upload(words, torch.int32, device))
    return DrawInputs(
        draws=draws,
        greedy=_row_index(greedy, len(draws), device),
        sampled=_row_index(sampled, len(draws), device),
        settings=_settings([draws[i] for i in sampled], [uniforms[i] for i in sampled], device) if sampled else None,
        grammar=grammar,
        scored=_row_index(scored, len(draws), device),
    )


def _row_index(rows: list[int], count: int, device: torch.device) -> RowIndex:
    every = rows == list(range(count))
    return RowIndex(rows, None if every or not rows else upload(rows, torch.int64, device))


def _settings(draws: list[SeqDraw], uniforms: list[float], device: torch.device) -> DrawSettings:
    """One host-to-device copy of every sampled row's settings (a top-k past 2^31 cuts nothing anyway)."""
    rows = [[d.temperature, d.top_p, d.min_p, u, min(d.top_k, 1 << 31)] for d, u in zip(draws, uniforms)]
    table = upload(rows, torch.float64, device)  # [R, 5]
    every_row_cuts = all(d.top_k > 0 for d in draws)
    return DrawSettings(table, max(d.top_k for d in draws) if every_row_cuts else 0)
