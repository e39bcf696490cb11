"""The scheduler's output contract: what one step computes, sent to every model rank.

A step computes, for each scheduled sequence, its tokens [num_computed, num_computed + len(new_token_ids)).
When that reaches the end of the sequence, the rank draws the next token with the sequence's keyed rule.
A verify round appends drafts d1..dK to the last known token: its K+1 last rows each draw, row i with the
keyed rule at its own reply position, so a kept draft is exactly the token serial decoding would draw there.
A sequence asking for prompt logprobs also gets a row for each prompt position of the step (`prompt_rows`).
Prefill chunks, prefix hits, recomputation after preemption, decode and verify rounds are all this one shape.
A sequence with images also says where their placeholders sit (multimodal positions) and, the first time a
step reaches an image, its patches: the rank encodes it once and keeps the embeddings until its last
placeholder row is computed (docs/engine.md, Vision).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from deployments.messages.replies import LogprobRow, PromptLogprobRow

if TYPE_CHECKING:
    import torch


ZERO_STATE = -1  # a SeqStep.state_from: the sequence starts from zeroed states (nothing computed yet)


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
class Proposal:
    """Drafts the rank's MTP layer proposes for a sequence's next round (set by the rank, checked by the engine).

    They continue the sequence as the rank saw it after the step: its token at `after` was `last_token`.
    The engine drops them when the reply it wrote differs (a cut, a forced close, a stop).
    """

    after: int  # position of the last token the drafts continue
    last_token: int
    token_ids: list[int]


@dataclass
class MtpWork:
    """The MTP layer's share of a step (timed by the rank, so the engine can weigh drafting's cost)."""

    seconds: float = 0.0  # all of it, the passes and the work between them
    # (rows, seconds) of each forward pass: one over the step's rows, then one per chained draft
    timed: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepOutput:
    """What a rank returns for one step (rank 0's is used)."""

    # One per drawn row, in plan order: a sequence's `draw` first, then its `draft_draws`.
    draws: list[StepResult] = field(default_factory=list)
    # Rows of the sequences with `prompt_rows`, keyed by their index in `StepPlan.seqs`.
    prompt_rows: dict[int, list[PromptLogprobRow]] = field(default_factory=dict)
    proposals: dict[int, Proposal] = field(default_factory=dict)  # keyed by index in `StepPlan.seqs`
    mtp: MtpWork | None = None  # set when the step ran the MTP layer


@dataclass
class StepImage:
    """An image some of whose placeholder rows a step computes (set by the planner from an `ImageInput`)."""

    key: str  # the rank's name for its embeddings: unique per request and image
    offset: int  # the sequence position of its first placeholder
    token_grid: tuple[int, int, int]  # its placeholders as (frames, rows, columns): the patch grid merged
    patch_grid: tuple[int, int, int]  # the tower's patch grid (transformers' `image_grid_thw` row)
    # The patches [t * h * w, C * Tp * P * P] float32, sent with the first step reaching the image (or the
    # first after the rank dropped it); None: the rank holds its embeddings from an earlier step.
    pixel_values: np.ndarray | None = None

    @property
    def length(self) -> int:
        t, h, w = self.token_grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def position_shift(self) -> int:
        """How far the rotary positions of the tokens after it move: an image takes max(rows, columns)
        positions (transformers' rope index), not its placeholder count."""
        return max(self.token_grid[1], self.token_grid[2]) - self.length


@dataclass
class SeqStep:
    """One sequence's share of a step."""

    new_token_ids: list[int]  # tokens computed this step
    num_computed: int  # tokens already in the cache before this step (also the first new position)
    block_ids: list[int]  # the sequence's cache blocks covering num_computed + len(new_token_ids) tokens
    draw: SeqDraw | None = None  # set when this step ends at the sequence's last token
    # A verify round: the last len(draft_draws) new tokens are drafts, and row i of them draws with
    # draft_draws[i] (reply position and grammar mask as if the drafts before it were kept).
    draft_draws: list[SeqDraw] = field(default_factory=list)
    prompt_rows: PromptRowsWanted | None = None  # set when the step covers prompt positions needing rows
    # MTP drafting (the sequence drafts with the MTP layer): its rows of this step feed the MTP layer's cache,
    # and `propose` drafts are wanted for the next round (0: none).
    mtp: bool = False
    propose: int = 0
    next_token_id: int | None = None  # the token after the step's last row when that row draws nothing
    # Hybrid models (recurrent layers): the sequence's running state slot; a copy into it before the step
    # (ZERO_STATE: start from the first token; another slot: a cached prefix's snapshot, or the state a
    # verify round kept); and the slots given the states after rows of this step (row offset, slot).
    state_slot: int = -1
    state_from: int | None = None
    state_captures: list[tuple[int, int]] = field(default_factory=list)
    # Images (multimodal models): the position shift of the images wholly before the step's first row
    # (added to every row's rotary position), and the images whose placeholder rows the step covers.
    rope_delta: int = 0
    images: list[StepImage] = field(default_factory=list)
    # Living weights (docs/slide.md): the pocket version the sequence is computed with, and the key its rows
    # are captured under for training (None: not captured).
    pocket_version: int = 0
    capture: str | None = None

    @property
    def draws(self) -> list[SeqDraw]:
        """Every draw of the step, in row order."""
        return [] if self.draw is None else [self.draw, *self.draft_draws]

    @property
    def num_drafts(self) -> int:
        return len(self.draft_draws)


@dataclass
class StepPlan:
    """One forward pass (built by the planner, executed by the ranks)."""

    kind: str  # "prefill" (a chunk of prompts) or "decode" (a round of running replies)
    seqs: list[SeqStep] = field(default_factory=list)
    # Keys of image embeddings a rank holds for sequences that ended or were preempted mid-image: drop them.
    drop_images: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.new_token_ids) for s in self.seqs)
