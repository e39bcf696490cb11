"""The scheduler's output contract: what one step computes, sent to every model rank.

A step computes, for each scheduled sequence, its tokens [num_computed, num_computed + len(new_token_ids)).
When that reaches the end of the sequence, the rank draws the next token with the sequence's keyed rule.
A sequence asking for prompt logprobs also gets a row for each prompt position of the step (`prompt_rows`).
Prefill chunks, prefix hits, recomputation after preemption and decode rounds are all this one shape.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deployments.types import LogprobRow, PromptLogprobRow

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
class PromptRowsWanted:
    """The prompt positions of one sequence's step whose rows are wanted (a request with prompt_logprobs).

    Position j's logits give the distribution of prompt token j + 1, so each wanted position names that token.
    """

    top: int  # best tokens listed per row
    first: int  # offset into the step's new_token_ids of the first wanted position
    next_ids: list[int]  # the prompt token after each wanted position, in order (one row each)


@dataclass
class StepOutput:
    """What a rank returns for one step (rank 0's is used)."""

    draws: list[StepResult] = field(default_factory=list)  # one per sequence with a draw, in plan order
    # Rows of the sequences with `prompt_rows`, keyed by their index in `StepPlan.seqs`.
    prompt_rows: dict[int, list[PromptLogprobRow]] = field(default_factory=dict)


@dataclass
class SeqStep:
    """One sequence's share of a step."""

    new_token_ids: list[int]  # tokens computed this step
    num_computed: int  # tokens already in the cache before this step (also the first new position)
    block_ids: list[int]  # the sequence's cache blocks covering num_computed + len(new_token_ids) tokens
    draw: SeqDraw | None = None  # set when this step ends at the sequence's last token
    prompt_rows: PromptRowsWanted | None = None  # set when the step covers prompt positions needing rows


@dataclass
class StepPlan:
    """One forward pass (built by the planner, executed by the ranks)."""

    kind: str  # "prefill" (a chunk of prompts) or "decode" (a round of running replies)
    seqs: list[SeqStep] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.new_token_ids) for s in self.seqs)
