"""Engine counters (monotonic totals a poller differences into rates) and the live rates /health shows."""

import copy
import time
from collections import deque
from dataclasses import dataclass, field

from deployments.scheduler.metrics import RequestHistograms
from deployments.types import FinishReason, RequestStats

RATE_WINDOW_SECONDS = 2.0


@dataclass
class EngineCounters:
    requests_total: int = 0  # finished requests, whatever the reason
    requests_aborted_total: int = 0  # the client left
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

    def finished(self, stats: RequestStats, reason: FinishReason, key_label: str = "none") -> None:
        self.requests_total += 1
        self.requests_by_key[key_label] = self.requests_by_key.get(key_label, 0) + 1
        if stats.route_reason:  # empty: Serve's own router chose (one replica, or affinity routing off)
            self.requests_by_route[stats.route_reason] = self.requests_by_route.get(stats.route_reason, 0) + 1
        self.generation_tokens_total += stats.completion_tokens
        self.histograms.observe(stats, reason)
        if reason == FinishReason.ABORT:
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


class LiveRates:
    """Decode tokens in the last 2 s over 2; the last prompt pass's rate, shown for 2 s after it."""

    def __init__(self) -> None:
        self._decoded: deque[tuple[float, int]] = deque()
        self._prefill_rate = 0.0
        self._prefill_at = 0.0

    def decoded(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._decoded.append((now, tokens))
        self._trim(now)

    def prefill_pass(self, tokens: int, seconds: float, now: float | None = None) -> None:
        self._prefill_at = time.monotonic() if now is None else now
        self._prefill_rate = tokens / seconds if seconds > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._decoded and self._decoded[0][0] < now - RATE_WINDOW_SECONDS:
            self._decoded.popleft()

    def decode_rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [n for t, n in list(self._decoded) if t >= now - RATE_WINDOW_SECONDS]
        return round(sum(recent) / RATE_WINDOW_SECONDS, 1)

    def prefill_rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if now - self._prefill_at > RATE_WINDOW_SECONDS:
            return 0.0
        return round(self._prefill_rate, 1)
