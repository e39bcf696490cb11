"""Per-replica request histograms, kept beside EngineCounters and merged bucket-wise by Ingress.

Each Scheduler replica observes every finished request's latency figures into fixed buckets (the same
bounds on every replica, so Ingress merges them by adding counts). Plain Python, no prometheus registry:
the snapshot crosses the Ray boundary inside `ReplicaStatus.counters` and Ingress builds the exposition.
"""

import copy
from dataclasses import dataclass, field

from deployments.messages.replies import FinishReason, RequestStats

# Seconds; vLLM's latency bounds (its dashboards' quantiles read the same), plus +Inf implied.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# Time per output token is far shorter than a request: finer low buckets.
TPOT_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "latency": LATENCY_BUCKETS,  # arrival to last token
    "ttft": LATENCY_BUCKETS,  # arrival to first token
    "decode": LATENCY_BUCKETS,  # end of the prompt pass to the last token
    "tpot": TPOT_BUCKETS,  # decode time over the tokens after the first
    "prefill": LATENCY_BUCKETS,  # the request's prompt chunks
}


@dataclass
class Histogram:
    """Non-cumulative counts per bucket (the last one is +Inf), with the sum of observed values."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total)

    def merge(self, other: "Histogram") -> None:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be merged")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as the exposition writes them, ending with +Inf."""
        pairs: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            pairs.append((bound, running))
        return pairs

    def quantile(self, q: float) -> float | None:
        """The bucket bound under which a fraction q of observations fall (None when empty)."""
        total = self.count
        if total == 0:
            return None
        running = 0
        for index, count in enumerate(self.counts):
            running += count
            if running >= q * total:
                return self.bounds[index] if index < len(self.bounds) else self.bounds[-1]
        return self.bounds[-1]


def empty_histograms() -> dict[str, Histogram]:
    return {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}


@dataclass
class RequestTimings:
    """One finished request's figures, each None where the request never reached that phase."""

    latency: float | None
    ttft: float | None
    decode: float | None
    tpot: float | None
    prefill: float | None

    @classmethod
    def of(cls, stats: RequestStats, reason: FinishReason) -> "RequestTimings":
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)
        first = stats.first_token_time
        decoded = first is not None and completed
        return cls(
            latency=max(0.0, stats.finish_time - stats.arrival_time) if completed else None,
            ttft=max(0.0, first - stats.arrival_time) if first is not None else None,
            decode=stats.decode_seconds if decoded else None,
            tpot=stats.decode_seconds / (stats.completion_tokens - 1)
            if decoded and stats.completion_tokens > 1
            else None,
            prefill=stats.prefill_seconds if stats.prefill_widths else None,
        )

    def items(self) -> list[tuple[str, float]]:
        values = {
            "latency": self.latency,
            "ttft": self.ttft,
            "decode": self.decode,
            "tpot": self.tpot,
            "prefill": self.prefill,
        }
        return [(name, value) for name, value in values.items() if value is not None]


@dataclass
class RequestHistograms:
    """The five latency histograms of one replica (finished requests only)."""

    histograms: dict[str, Histogram] = field(default_factory=empty_histograms)

    def observe(self, stats: RequestStats, reason: FinishReason) -> None:
        for name, value in RequestTimings.of(stats, reason).items():
            self.histograms[name].observe(value)

    def merge(self, other: "RequestHistograms") -> None:
        for name, histogram in other.histograms.items():
            self.histograms[name].merge(histogram)

    def snapshot(self) -> "RequestHistograms":
        return RequestHistograms({name: h.copy() for name, h in self.histograms.items()})


@dataclass
class EngineCounters:
    requests_total: int = 0  # finished requests, whatever the reason
    requests_aborted_total: int = 0  # the client left (streamed replies: reported by Ingress, `client_left`)
    requests_failed_total: int = 0
    prompt_tokens_total: int = 0  # of finished requests
    cached_tokens_total: int = 0  # prompt tokens of finished requests found in the prefix cache
    disk_tokens_total: int = 0  # of those, read back from the disk store
    completion_tokens_total: int = 0  # every reply token drawn, running replies included
    prefill_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    rounds_total: int = 0  # decode rounds run
    preemptions_total: int = 0
    generation_tokens_total: int = 0  # reply tokens of finished requests
    requests_by_key: dict[str, int] = field(default_factory=dict)  # finished requests per API-key label
    requests_by_route: dict[str, int] = field(default_factory=dict)  # finished requests per router reason
    histograms: RequestHistograms = field(default_factory=RequestHistograms)
    drafted_total: int = 0  # draft tokens verified, of finished requests
    accepted_total: int = 0  # of those, kept
    draft_rounds_total: int = 0  # verify rounds that carried drafts, of finished requests (vLLM's num_drafts)
    accepted_by_position: dict[int, int] = field(default_factory=dict)  # draft position k -> kept drafts there

    def finished(
        self, stats: RequestStats, reason: FinishReason, key_label: str = "none", departure_counted: bool = False
    ) -> None:
        """`departure_counted`: a client leaving this request is counted elsewhere (a streamed reply, by
        Ingress through `client_left`), so its abort is not counted here."""
        self.requests_total += 1
        self.requests_by_key[key_label] = self.requests_by_key.get(key_label, 0) + 1
        if stats.route_reason:  # empty: Serve's own router chose (one replica, or affinity routing off)
            self.requests_by_route[stats.route_reason] = self.requests_by_route.get(stats.route_reason, 0) + 1
        self.generation_tokens_total += stats.completion_tokens
        self.histograms.observe(stats, reason)
        if reason == FinishReason.ABORT and not departure_counted:
            self.requests_aborted_total += 1
        elif reason == FinishReason.ERROR:
            self.requests_failed_total += 1
        self.prompt_tokens_total += stats.prompt_tokens
        self.cached_tokens_total += stats.cached_tokens
        self.disk_tokens_total += stats.disk_tokens
        self.prefill_seconds_total += stats.prefill_seconds
        self.decode_seconds_total += stats.decode_seconds
        self.drafted_total += stats.drafted
        self.accepted_total += stats.accepted
        self.draft_rounds_total += stats.draft_rounds
        for position, kept in enumerate(stats.accepted_per_position):
            self.accepted_by_position[position] = self.accepted_by_position.get(position, 0) + kept

    def snapshot(self) -> "EngineCounters":
        # Runs after every step: copy the mutable parts by hand rather than deepcopy the lot.
        copied = copy.copy(self)
        copied.requests_by_key = dict(self.requests_by_key)
        copied.requests_by_route = dict(self.requests_by_route)
        copied.accepted_by_position = dict(self.accepted_by_position)
        copied.histograms = self.histograms.snapshot()
        return copied
