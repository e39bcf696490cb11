"""Drafts on the engine side: n-gram lookup, each sequence's acceptance, and how many drafts a round verifies.

Drafts never decide a token: a verify row draws with the keyed rule at its own reply position, and a draft
is kept only when it equals that draw. So this module is about speed alone: propose likely tokens, and pick
per round the draft lengths that maximise tokens per second given the measured step cost.
"""

from collections import deque
from dataclasses import dataclass, field

NGRAM_MIN, NGRAM_MAX = 2, 5  # suffix lengths looked up; one-token matches propose too much noise
DEFAULT_DRAFTS = {"mtp": 3, "ngram": 4}  # drafts per round at most, when draft_tokens is unset (README)
PRIOR_ACCEPTANCE = 0.8  # per-draft acceptance assumed before a method has been measured (MTP layers are
# trained to be right most of the time; a method that proves worse is measured down within a few rounds)
PRIOR_WEIGHT = 2.0  # pseudo-drafts of the method's rate a sequence's own rate starts from
COST_WINDOW = 64  # decode steps the step-cost fit looks back over
PRIOR_ROW_SHARE = 0.04  # before rows vary, each extra row is assumed to cost 4% of a step's fixed part
PRIOR_MTP_SHARE = 0.5  # before the MTP layer has run, one pass of it is assumed to cost half a step


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
    last_length: int = 0  # drafts the latest round planned for it (how deep the MTP layer chains next)

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


class MtpCost:
    """Seconds of one pass of the MTP layer by its width (rows), from the passes the rank timed.

    Not linear in rows: a MoE layer's cost jumps as more experts get tokens, so each width bucket (1, 2-3,
    4-7, ...) keeps its own recent mean, and a width never seen takes the nearest bucket's.
    """

    def __init__(self) -> None:
        self._by_bucket: dict[int, list[float]] = {}  # bucket -> [decayed seconds, decayed passes]

    def record(self, rows: int, seconds: float) -> None:
        mean = self._by_bucket.setdefault(rows.bit_length(), [0.0, 0.0])
        mean[0], mean[1] = mean[0] * 0.95 + seconds, mean[1] * 0.95 + 1.0

    def pass_seconds(self, rows: int, step_seconds: float) -> float:
        """One pass over `rows` rows; before any pass was timed, a share of `step_seconds` (a plain step)."""
        if not self._by_bucket or rows <= 0:
            return PRIOR_MTP_SHARE * step_seconds if rows > 0 else 0.0
        bucket = min(self._by_bucket, key=lambda b: (abs(b - rows.bit_length()), -b))
        total, count = self._by_bucket[bucket]
        return total / count


@dataclass
class RoundCosts:
    """What a decode round costs, from the fits (seconds)."""

    fixed: float  # a decode step's fixed part
    per_row: float  # each verify or decode row
    mtp: MtpCost | None = None  # the MTP layer's passes (None: the drafter needs no forward pass)

    def seconds(self, rows: int, drafts: int, widths: list[int]) -> float:
        """A round of `rows` plain rows plus `drafts` verify rows. With MTP, one pass over every row keeps the
        layer's cache whole (every round pays it: a row it skipped would leave a hole later drafts attend to)
        and makes each first draft; `widths[j]` sequences then chain draft j + 2, one pass each."""
        seconds = self.fixed + self.per_row * (rows + drafts)
        if self.mtp is not None:
            step = self.fixed + self.per_row * rows
            seconds += self.mtp.pass_seconds(rows + drafts, step)
            seconds += sum(self.mtp.pass_seconds(width, step) for width in widths[1:])
        return seconds


def choose_lengths(rates: list[float], caps: list[int], costs: RoundCosts) -> list[int]:
    """Drafts per sequence for one round, maximising expected tokens per second (all zeros: plain decode).

    Sequence s keeps its k-th draft with chance rates[s]**k. Every depth D is tried with each sequence
    drafting min(D, cap) (each chained MTP draft adds a whole pass, a step in cost that a greedy walk from
    zero would not see past); then, least likely first, drafts whose expected tokens are worth less than
    the time their row takes are dropped. O(rows x depth) per round.
    """
    rows = len(rates)
    best_lengths, best_rate = [0] * rows, rows / costs.seconds(rows, 0, [])
    tokens, drafts, widths = float(rows), 0, []
    for depth in range(1, max(caps, default=0) + 1):
        width = 0
        for rate, cap in zip(rates, caps):
            if cap >= depth:
                tokens += rate**depth
                drafts += 1
                width += 1
        widths.append(width)
        rate = tokens / costs.seconds(rows, drafts, widths)
        if rate > best_rate:
            best_lengths, best_rate = [min(depth, cap) for cap in caps], rate
    if not any(best_lengths):
        return best_lengths
    depth = max(best_lengths)
    widths = [sum(k >= j for k in best_lengths) for j in range(1, depth + 1)]
    tokens = rows + sum(rates[s] ** k for s in range(rows) for k in range(1, best_lengths[s] + 1))
    drafts = sum(best_lengths)
    # Deepest drafts first within a sequence, least likely first overall; a drop must keep one draft.
    for _, s in sorted((rates[s] ** best_lengths[s], s) for s in range(rows) if best_lengths[s]):
        while best_lengths[s] and drafts > 1:
            k = best_lengths[s]
            trial_widths = widths[: k - 1] + [widths[k - 1] - 1] + widths[k:]
            trial_widths = trial_widths if trial_widths[-1] else trial_widths[:-1]
            now = tokens / costs.seconds(rows, drafts, widths)
            if (tokens - rates[s] ** k) / costs.seconds(rows, drafts - 1, trial_widths) <= now:
                break
            tokens, drafts, widths = tokens - rates[s] ** k, drafts - 1, trial_widths
            best_lengths[s] -= 1
    return best_lengths
