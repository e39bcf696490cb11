"""Which drafts each decode round verifies: the planner asks here for every decoding sequence's drafts.

The engine's one drafter (`mtp` or `ngram`) proposes; `choose_lengths` cuts each proposal to the length the
measured acceptance and step cost make worth it; the reply limit and the grammar cut it further.
"""

from deployments.scheduler.drafts import DEFAULT_DRAFTS, DraftState, MethodRate, NgramIndex, StepCost, choose_lengths
from deployments.scheduler.sequence import Sequence


class DraftRounds:
    def __init__(self, method: str, max_drafts: int | None) -> None:
        self.method = method  # "mtp" or "ngram"
        self.max_drafts = max_drafts or DEFAULT_DRAFTS[method]
        self.rate = MethodRate()
        self.cost = StepCost()

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

    def for_round(self, decoding: list[Sequence]) -> dict[int, list[int]]:
        """Each decoding sequence's drafts for this round (keyed by id(seq); absent: none)."""
        offered = {id(seq): self.proposals(seq) for seq in decoding}
        drafting = [seq for seq in decoding if offered[id(seq)]]
        if not drafting:
            return {}
        fixed, per_row = self.cost.fit()
        rates = [seq.draft.acceptance(self.rate.rate) for seq in drafting]  # type: ignore[union-attr]
        caps = [len(offered[id(seq)]) for seq in drafting]
        # Sequences with nothing to verify still take a row each: they are part of the round's cost.
        lengths = choose_lengths(rates + [0.0] * (len(decoding) - len(drafting)),
                                 caps + [0] * (len(decoding) - len(drafting)), fixed, per_row)  # fmt: skip
        return {id(seq): offered[id(seq)][:k] for seq, k in zip(drafting, lengths) if k > 0}

    def to_propose(self, seq: Sequence) -> int:
        """MTP drafts the rank should chain for the sequence's next round."""
        state = seq.draft
        if state is None or state.method != "mtp":
            return 0
        return min(self.max_drafts, self.room(seq), state.last_length + 1) or min(1, self.room(seq))

    def record_round(self, rows: int, seconds: float) -> None:
        self.cost.record(rows, seconds)

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
        """A verify round's outcome for one sequence: its acceptance and next proposal length."""
        state = seq.draft
        if state is None:
            return
        state.last_length = drafted
        if drafted:
            state.record(drafted, kept)
            self.rate.record(drafted, kept)
