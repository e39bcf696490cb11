"""A step's draws as device tensors, uploaded without waiting on the device.

Rows are drawn in up to four groups: greedy or sampled, free or under a grammar. A sampled row's uniform is
its key's (sampler.keyed_uniform), computed on the host; a grammar row sends xgrammar's packed bitmask words
(a mask that allows nothing is a dead end and draws freely, as the matcher then refuses the token and ends
that request). The sampled rows' settings travel as one float64 table, read by keyed_draw.py.
"""

from dataclasses import dataclass

import torch

from deployments.messages.step import SeqDraw
from deployments.model_rank.host_reads import upload


@dataclass
class DrawSettings:
    """The sampled rows' settings on the device: `table` [R, 5] float64, one row per draw of (temperature
    above 0, top_p in (0, 1], min_p in [0, 1], the key's uniform in [0, 1), top_k: 0 off)."""

    table: torch.Tensor
    top_k_max: int  # the largest top-k of the rows, 0 when some row does not cut at top-k

    @property
    def temperature(self) -> torch.Tensor:
        return self.table[:, 0:1]

    @property
    def top_p(self) -> torch.Tensor:
        return self.table[:, 1:2]

    @property
    def min_p(self) -> torch.Tensor:
        return self.table[:, 2:3]

    @property
    def uniform(self) -> torch.Tensor:
        return self.table[:, 3:4]

    @property
    def top_k(self) -> torch.Tensor:
        return self.table[:, 4:5].to(torch.int64)

    def rows(self, row: int) -> "DrawSettings":
        """One row's settings."""
        top_k = int(self.table[row, 4])
        return DrawSettings(self.table[row : row + 1], top_k if self.top_k_max else 0)


@dataclass
class RowIndex:
    """Some of a step's rows: their positions on the host and on the device (None: all of them)."""

    rows: list[int]
    index: torch.Tensor | None


@dataclass
class RowGroup:
    """Rows drawn one way: their settings if sampled (else greedy), their packed allowed-id words [Rg, W]
    (int32) if under a grammar."""

    rows: RowIndex
    settings: DrawSettings | None
    words: torch.Tensor | None


@dataclass
class DrawInputs:
    draws: list[SeqDraw]
    groups: list[RowGroup]
    scored: RowIndex  # rows wanting logprobs or scores, read from the raw logits


def build_inputs(draws: list[SeqDraw], uniforms: list[float], device: torch.device) -> DrawInputs:
    """`uniforms`: each draw's keyed uniform (read by sampled rows only)."""
    constrained = [d.allowed is not None and bool(d.allowed.any()) for d in draws]
    groups = []
    for sampled in (False, True):
        for grammar in (False, True):
            rows = [i for i, d in enumerate(draws) if (d.temperature > 0.0) == sampled and constrained[i] == grammar]
            if rows:
                groups.append(_group(draws, uniforms, rows, sampled, grammar, device))
    scored = [i for i, d in enumerate(draws) if d.want_logprobs is not None or d.score_ids is not None]
    return DrawInputs(draws, groups, _row_index(scored, len(draws), device))


def _group(
    draws: list[SeqDraw], uniforms: list[float], rows: list[int], sampled: bool, grammar: bool, device: torch.device
) -> RowGroup:
    settings = _settings([draws[i] for i in rows], [uniforms[i] for i in rows], device) if sampled else None
    words = upload(torch.stack([draws[i].allowed for i in rows]), torch.int32, device) if grammar else None  # type: ignore[misc]
    return RowGroup(_row_index(rows, len(draws), device), settings, words)


def _row_index(rows: list[int], count: int, device: torch.device) -> RowIndex:
    every = rows == list(range(count))
    return RowIndex(rows, None if every or not rows else upload(rows, torch.int64, device))


def _settings(draws: list[SeqDraw], uniforms: list[float], device: torch.device) -> DrawSettings:
    """One host-to-device copy of every sampled row's settings (a top-k past 2^31 cuts nothing anyway)."""
    rows = [[d.temperature, d.top_p, d.min_p, u, min(d.top_k, 1 << 31)] for d, u in zip(draws, uniforms)]
    table = upload(rows, torch.float64, device)  # [R, 5]
    every_row_cuts = all(d.top_k > 0 for d in draws)
    return DrawSettings(table, max(d.top_k for d in draws) if every_row_cuts else 0)
