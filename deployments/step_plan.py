"""The scheduler's output contract: what one step computes, sent to every model rank.

A step computes, for each scheduled sequence, its tokens [num_computed, num_computed + len(new_token_ids)).
When that reaches the end of the sequence, the rank draws the next token with the sequence's keyed rule.
Prefill chunks, prefix hits, recomputation after preemption and decode rounds are all this one shape.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deployments.types import LogprobRow

if TYPE_CHECKING:
    import torch


@dataclass
class SeqDraw:
    """How to draw one sequence's next token (set by the scheduler from the request's sampling params)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int  # the request's sampling key
    reply_position: int  # index of the token being drawn within the reply (0 = first reply token)
    # xgrammar's packed int32 bitmask [ceil(V / 32)] of the tokens the row's grammar allows; None = all.
    allowed: "torch.Tensor | None" = None
    want_logprobs: int | None = None  # None: no logprobs; k: the drawn token's logprob and k alternatives
    score_ids: list[int] | None = None  # a scoring request: these ids' raw log-probabilities are wanted


@dataclass
class StepResult:
    """What a rank returns for one drawn row (rank 0's are used)."""

    token: int
    logprobs: LogprobRow | None = None  # set when the row's draw asked for logprobs
    scores: list[float] | None = None  # the raw log-probability of each of the draw's score_ids


@dataclass
class SeqStep:
    """One sequence's share of a step."""

    new_token_ids: list[int]  # tokens computed this step
    num_computed: int  # tokens already in the cache before this step (also the first new position)
    block_ids: list[int]  # the sequence's cache blocks covering num_computed + len(new_token_ids) tokens
    draw: SeqDraw | None = None  # set when this step ends at the sequence's last token


@dataclass
class StepPlan:
    """One forward pass (built by the planner, executed by the ranks)."""

    kind: str  # "prefill" (a chunk of prompts) or "decode" (a round of running replies)
    seqs: list[SeqStep] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.new_token_ids) for s in self.seqs)
