"""Drafts on the engine side: n-gram lookup, each sequence's acceptance, and how many drafts a round verifies.

Drafts never decide a token: a verify row draws with the keyed rule at its own reply position, and a draft
is kept only when it equals that draw. So this module is about speed alone: propose likely tokens, and pick
per round the draft lengths that maximise tokens per second given the measured step cost.
"""

from collections import deque
from dataclasses import dataclass, field

NGRAM_MIN, NGRAM_MAX = 2, 5  # suffix lengths looked up; one-token matches propose too much noise
DEFAULT_DRAFTS = {"mtp": 3, "ngram": 4}  # drafts per round at most, when draft_tokens is unset (README)
PRIOR_ACCEPTANCE = 0.6  # per-draft acceptance assumed before a method has been measured
PRIOR_WEIGHT = 2.0  # pseudo-drafts of the method's rate a sequence's own rate starts from
COST_WINDOW = 64  # decode steps the step-cost fit looks back over
PRIOR_ROW_SHARE = 0.04  # before rows vary, each extra row is assumed to cost 4% of a step's fixed part


class NgramIndex:
    """Where each n-gram of a sequence last occurred, kept up to date as tokens are appended (prompt lookup).

    `propose` finds the longest suffix of the tokens (NGRAM_MAX down to NGRAM_MIN) seen earlier and returns
    the tokens that followed its latest earlier occurrence.
    """

    def __init__(self) -> None:
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after it
        self._indexed = 0  # tokens[:_indexed] have had their n-grams recorded

    def _catch_up(self, tokens: list[int]) -> None:
        # An n-gram ending just before position p is recorded once token p exists: the suffix never finds itself.
        for end in range(max(self._indexed, 1), len(tokens)):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    self._follows[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], count: int) -> list[int]:
        self._catch_up(tokens)
        for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
            start = self._follows.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + count]
        return []


@dataclass
class DraftState:
    """One sequence's drafting (set by the engine; read by the planner)."""

    method: str  # "mtp" or "ngram"
    proposed: list[int] = field(default_factory=list)  # MTP drafts waiting for the next round
    proposed_after: int = -1  # the position of the token those drafts continue
    ngrams: NgramIndex | None = None
    kept: int = 0  # drafts kept so far
    rejected: int = 0  # rounds that rejected a draft (each ends a run: the geometric estimate's failures)
    last_length: int = 0  # drafts the latest round verified

    def acceptance(self, method_rate: float) -> float:
        """The chance each further draft is kept, from this sequence's record and the method's rate."""
        return (self.kept + PRIOR_WEIGHT * method_rate) / (self.kept + self.rejected + PRIOR_WEIGHT)

    def record(self, drafted: int, kept: int) -> None:
        self.kept += kept
        self.rejected += int(kept < drafted)


class MethodRate:
    """A method's per-draft acceptance over recent rounds (the prior of new sequences)."""

    def __init__(self) -> None:
        self.kept, self.rejected = 0.0, 0.0

    def record(self, drafted: int, kept: int) -> None:
        decay = 0.98  # recent replies count most
        self.kept = self.kept * decay + kept
        self.rejected = self.rejected * decay + int(kept < drafted)

    @property
    def rate(self) -> float:
        return (self.kept + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self.kept + self.rejected + PRIOR_WEIGHT)


class StepCost:
    """Decode-step seconds as fixed + per_row * rows, fitted over the latest steps."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)

    def record(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))

    def fit(self) -> tuple[float, float]:
        """(fixed, per_row) seconds; before two row counts are seen the slope is a share of the mean step."""
        if not self._steps:
            return 1.0, PRIOR_ROW_SHARE
        n = len(self._steps)
        mean_rows = sum(r for r, _ in self._steps) / n
        mean_seconds = sum(s for _, s in self._steps) / n
        spread = sum((r - mean_rows) ** 2 for r, _ in self._steps)
        if spread >= 1.0:
            slope = sum((r - mean_rows) * (s - mean_seconds) for r, s in self._steps) / spread
            fixed = mean_seconds - slope * mean_rows
            if slope >= 0 and fixed > 0:
                return fixed, slope
        slope = PRIOR_ROW_SHARE * mean_seconds
        return max(mean_seconds - slope * mean_rows, slope), slope


def choose_lengths(rates: list[float], caps: list[int], fixed: float, per_row: float) -> list[int]:
    """Drafts per sequence for one round, maximising expected tokens per second.

    Sequence s with acceptance a keeps its k-th draft with chance a**k. Starting from plain decode rows, the
    next draft worth the most is added while its expected tokens per second of extra row beat the round's
    current tokens per second; that is where throughput stops rising (0 drafts when none pays).
    """
    lengths = [0] * len(rates)
    tokens = float(len(rates))  # each row draws one token at least
    seconds = fixed + per_row * len(rates)
    while True:
        best, gain = -1, 0.0
        for s, (rate, cap) in enumerate(zip(rates, caps)):
            if lengths[s] < cap:
                value = rate ** (lengths[s] + 1)
                if value > gain:
                    best, gain = s, value
        if best < 0 or gain * seconds <= tokens * per_row:
            return lengths
        lengths[best] += 1
        tokens += gain
        seconds += per_row
