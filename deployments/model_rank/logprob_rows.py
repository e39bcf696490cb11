"""Logprob rows, scores and prompt-logprob rows, computed where the logits are (docs/engine.md).

Each describes the raw distribution at temperature 1, a float64 log-softmax of the row's unmasked logits,
whatever the sampling settings. A row's best tokens are the head of its rank order (logit descending, ties
by lower id), the order the keyed draw reads; only the figures asked for are read back to the host.
"""

from dataclasses import dataclass

import torch

from deployments.messages.replies import LogprobRow, PromptLogprobRow
from deployments.model_rank import rank_head
from deployments.model_rank.host_reads import HostRead, HostReads, upload
from kernels import cpu_sampling


def best_ids(logits: torch.Tensor, top: int) -> torch.Tensor:
    """The first `top` ids [R, top] of each row's rank order (NaN read as -inf)."""
    top = min(top, logits.shape[-1])
    if top <= 0:
        return torch.zeros(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    if cpu_sampling.supports(logits):
        return cpu_sampling.rank_head(logits, top)[0]
    if logits.device.type != "cpu" or bool(logits.isnan().any()):
        logits = torch.where(logits.isnan(), float("-inf"), logits)
    return rank_head.top_of_rank(logits, top)[0]


@dataclass
class LogprobReads:
    """Rows' figures registered for the step's one read: each token's logprob, the best tokens
    (`width` per row) and their logprobs, and for prompt rows each token's rank."""

    chosen: HostRead
    best: HostRead
    best_logprobs: HostRead
    width: int
    rank: HostRead | None

    def logprob_rows(self, tokens: list[int], tops: list[int]) -> list[LogprobRow]:
        chosen, best, values = self.chosen.floats(), self.best.ints(), self.best_logprobs.floats()
        return [
            LogprobRow(token, chosen[row], self._top(best, values, row, top))
            for row, (token, top) in enumerate(zip(tokens, tops))
        ]

    def prompt_rows(self, tokens: list[int], top: int) -> list[PromptLogprobRow]:
        assert self.rank is not None
        chosen, ranks = self.chosen.floats(), self.rank.ints()
        best, values = self.best.ints(), self.best_logprobs.floats()
        return [
            PromptLogprobRow(token, chosen[row], ranks[row], self._top(best, values, row, top))
            for row, token in enumerate(tokens)
        ]

    def _top(self, best: list[int], values: list[float], row: int, top: int) -> list[tuple[int, float]]:
        start = row * self.width
        return list(zip(best[start : start + min(top, self.width)], values[start : start + min(top, self.width)]))


def read_figures(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    top: int,
    reads: HostReads,
    with_rank: bool = False,
    labels: list[list[int] | None] | None = None,
) -> tuple[LogprobReads, list[HostRead | None]]:
    """Register the figures of rows `logits` [R, V] for `tokens` [R] (on the logits' device): each token's
    logprob, the `top` best tokens and theirs, with `with_rank` how many tokens are at least as likely
    (vLLM's prompt-logprob rank), and each row's `labels`' logprobs (a scoring request's; None: none).

    On a CPU the float64 log-softmax runs a row at a time: the allocator then reuses one row's buffers,
    where [R, V] float64 temporaries cost more in fresh pages than in arithmetic."""
    rows = logits.shape[0]
    best = best_ids(logits, top)
    step = rows if logits.device.type != "cpu" else 1
    labels = labels or [None] * rows
    chosen, best_logprobs, ranks = [], [], []
    scores: list[HostRead | None] = []
    for start in range(0, rows, step):
        logprobs = torch.log_softmax(logits[start : start + step].to(torch.float64), dim=-1)
        chosen.append(logprobs.gather(1, tokens[start : start + step].unsqueeze(1)))  # [n, 1]
        best_logprobs.append(logprobs.gather(1, best[start : start + step]))
        if with_rank:
            ranks.append((logprobs >= chosen[-1]).sum(dim=-1))
        for offset, row_labels in enumerate(labels[start : start + step]):
            ids = None if row_labels is None else upload(row_labels, torch.int64, logits.device)
            scores.append(None if ids is None else reads.add(logprobs[offset].gather(0, ids)))
    rank = reads.add(torch.cat(ranks)) if with_rank else None
    figures = LogprobReads(
        reads.add(torch.cat(chosen)), reads.add(best), reads.add(torch.cat(best_logprobs)), best.shape[1], rank
    )
    return figures, scores
