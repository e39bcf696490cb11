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
        every = torch.full((logits.shape[0], 1), top, dtype=torch.int64)
        return cpu_sampling.rank_head(logits, every, None)[0][:, :top]
    clean = torch.where(logits.isnan(), float("-inf"), logits)
    return rank_head.top_of_rank(clean, top)[0]


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


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The raw distribution [R, V]: a float64 log-softmax of float32 logits."""
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def read_logprobs(
    logits: torch.Tensor,
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    top: int,
    reads: HostReads,
    with_rank: bool = False,
) -> LogprobReads:
    """Register the figures of rows `logits` [R, V] (their `raw_logprobs`) for `tokens` [R] (on the
    logits' device) and their `top` best tokens; `with_rank`: also how many tokens are at least as likely
    (vLLM's prompt-logprob rank)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [R, 1]
    best = best_ids(logits, top)
    rank = reads.add((logprobs >= chosen).sum(dim=-1)) if with_rank else None
    return LogprobReads(
        chosen=reads.add(chosen),
        best=reads.add(best),
        best_logprobs=reads.add(logprobs.gather(1, best)),
        width=best.shape[1],
        rank=rank,
    )


def read_scores(logprobs: torch.Tensor, ids: list[list[int]], reads: HostReads) -> list[HostRead]:
    """Register each row's raw log-probabilities (`raw_logprobs` [R, V]) of its `ids` (a scoring
    request's labels), in order."""
    return [
        reads.add(logprobs[row].gather(0, upload(row_ids, torch.int64, logprobs.device)))
        for row, row_ids in enumerate(ids)
    ]
