"""Engine counters (monotonic totals a poller differences into rates) and the live rates /health shows."""

import time
from collections import deque

RATE_WINDOW_SECONDS = 2.0


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
