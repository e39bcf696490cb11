"""Which drafts each decode round verifies: the planner asks here for every decoding sequence's drafts.

The engine's one drafter (`mtp` or `ngram`) proposes; `choose_lengths` cuts each proposal to the length the
measured acceptance and step cost make worth it; the reply limit and the grammar cut it further.
"""

from deployments.config import StartupError
from deployments.messages.step import MtpWork
from deployments.model_rank.runner import RunnerInfo
from deployments.scheduler.engine.drafts import (
    DEFAULT_DRAFTS,
    DraftState,
    MethodRate,
    MtpCost,
    NgramIndex,
    RoundCosts,
    StepCost,
    choose_lengths,
)
from deployments.scheduler.engine.sequence import Sequence

REFIT_ROUNDS = 8  # decode rounds between two fits of the cost model
MTP_FIT_ROWS = 128  # MTP passes wider than this (long prompt chunks) stay out of its cost model


def draft_method(wanted: str, runner: RunnerInfo) -> str:
    """The engine's drafter for the `draft` setting: the MTP layer where the ranks loaded one (auto, mtp),
    else n-gram lookup; "off" drafts nothing."""
    if wanted == "mtp" and not runner.mtp:
        raise StartupError(
            f"draft: mtp needs a checkpoint with an MTP layer (a glm4_moe model with num_nextn_predict_layers "
            f">= 1 and its model.layers.N weights); this {runner.model_type} checkpoint has none: "
            f"use --draft ngram, auto or off"
        )
    if wanted == "off":
        return "off"
    return "mtp" if runner.mtp else "ngram"


class DraftRounds:
    def __init__(self, method: str, max_drafts: int | None, fixed: bool = False) -> None:
        self.method = method  # "mtp" or "ngram"
        self.fixed = fixed  # every round drafts as much as it may, without the cost model
        self.max_drafts = max_drafts or DEFAULT_DRAFTS[method]
        self.rate = MethodRate()
        self.cost = StepCost()
        self.mtp_cost = MtpCost()
        self.depth = self.max_drafts  # the latest drafting round's deepest draft (what prompt passes propose)
        self._costs: RoundCosts | None = None
        self._since_fit = 0  # decode rounds recorded since the latest fit

    def start(self, seq: Sequence) -> None:
        """Give a new sequence its draft state (none for a `draft: false` or scoring request)."""
        if seq.request.draft and seq.request.score_token_ids is None:
            seq.draft = DraftState(self.method, ngrams=NgramIndex() if self.method == "ngram" else None)

    def room(self, seq: Sequence) -> int:
        """Drafts the reply limit leaves: the round's first draw writes one token, each kept draft one more."""
        return max(0, min(self.max_drafts, seq.max_tokens - seq.num_reply_tokens - 1))

    def proposals(self, seq: Sequence) -> list[int]:
        state = seq.draft
        if state is None:
            return []
        room = self.room(seq)
        if room == 0:
            return []
        if state.ngrams is not None:
            return state.ngrams.propose(seq.token_ids, room)
        if state.proposed_after != len(seq.token_ids) - 1:
            return []  # the drafts continue a reply other than the one written (a cut, a forced close)
        return state.proposed[:room]

    def costs(self) -> RoundCosts:
        """The cost model, refitted every REFIT_ROUNDS decode rounds (a fit per round would cost a round's %)."""
        if self._costs is None or self._since_fit >= REFIT_ROUNDS:
            fixed, per_row = self.cost.fit()
            mtp = self.mtp_cost if self.method == "mtp" else None
            self._costs, self._since_fit = RoundCosts(fixed, per_row, mtp), 0
        return self._costs

    def for_round(self, decoding: list[Sequence]) -> dict[int, list[int]]:
        """Each decoding sequence's drafts for this round (keyed by id(seq); absent: none).

        The lengths come from the cost model over every decoding row (`draft: false` ones cost rows too).
        MTP plans with the room its layer could fill (a sequence without proposals yet drafts next round).
        """
        drafting = [(seq, seq.draft) for seq in decoding if seq.draft is not None]
        for _, state in drafting:
            state.last_length = 0
        if not drafting:
            return {}
        offered = {id(seq): self.proposals(seq) for seq, _ in drafting}
        caps = [self.room(seq) if self.method == "mtp" else len(offered[id(seq)]) for seq, _ in drafting]
        rates = [state.acceptance(self.rate.rate) for _, state in drafting]
        idle = len(decoding) - len(drafting)
        if self.fixed:
            lengths = caps + [0] * idle
        else:
            lengths = choose_lengths(rates + [0.0] * idle, caps + [0] * idle, self.costs())
        if any(lengths):
            self.depth = max(lengths)
        chosen: dict[int, list[int]] = {}
        for (seq, state), k in zip(drafting, lengths):
            state.last_length = k
            if k and offered[id(seq)]:
                chosen[id(seq)] = offered[id(seq)][:k]
        return chosen

    @staticmethod
    def mtp_rows(seq: Sequence) -> bool:
        """Whether the sequence's rows feed the MTP layer: every step's, so its cache has no holes."""
        return seq.draft is not None and seq.draft.method == "mtp"

    def to_propose(self, seq: Sequence, decode: bool) -> int:
        """MTP drafts the rank should chain for the sequence's next round: as deep as this round's plan (a
        prompt pass: as deep as the latest drafting round), and one at least: the first comes with the pass
        the layer runs anyway."""
        state = seq.draft
        if state is None or state.method != "mtp":
            return 0
        return min(self.room(seq), max(1, state.last_length if decode else self.depth))

    def record_step(self, decode: bool, rows: int, seconds: float, mtp: MtpWork | None) -> None:
        """A step ran `rows` rows in `seconds`, `mtp` of it in the MTP layer. Decode rounds fit the step cost;
        the MTP layer's passes of prompt chunks count too (up to MTP_FIT_ROWS rows: decode-sized passes), so
        its cost is known at many widths even while rounds do not draft."""
        for width, pass_seconds in [] if mtp is None else mtp.timed:
            if width <= MTP_FIT_ROWS:
                self.mtp_cost.record(width, pass_seconds)
        if decode:
            self._since_fit += 1
            self.cost.record(rows, seconds - (0.0 if mtp is None else mtp.seconds))

    @staticmethod
    def count_round(seq: Sequence, drafted: int) -> None:
        """A verify round starts (counted before any token is written: the reply may end within it)."""
        if drafted == 0:
            return
        stats = seq.stats
        stats.drafted += drafted
        stats.draft_rounds += 1
        while len(stats.accepted_per_position) < drafted:
            stats.accepted_per_position.append(0)

    @staticmethod
    def count_kept(seq: Sequence, position: int) -> None:
        """Draft `position` of the round equalled its draw (counted before the token after it is written)."""
        seq.stats.accepted += 1
        seq.stats.accepted_per_position[position] += 1

    def record(self, seq: Sequence, drafted: int, kept: int) -> None:
        """A verify round's outcome for one sequence: its acceptance and the method's."""
        state = seq.draft
        if state is not None and drafted:
            state.record(drafted, kept)
            self.rate.record(drafted, kept)
