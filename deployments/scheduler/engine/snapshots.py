"""What the engine reports besides replies: the info snapshot (/health, /metrics, the finish log) with its
live rates, this process's memory figures, and the digest of its cached blocks for the prefix-affinity router.

Each turn of the loop (`Engine.run_once`) asks `Snapshots.take` whether to send them: the info when the
engine goes idle, when a request finished (its caller then finds it counted), else at most every
INFO_INTERVAL_S; the digest when the blocks changed, at most every DIGEST_INTERVAL_S while busy.
"""

import time
from collections import deque
from dataclasses import replace

from deployments.messages.counters import EngineCounters
from deployments.messages.engine_process import Stepped
from deployments.messages.prefix import PrefixDigest
from deployments.messages.status import EngineInfo
from deployments.messages.store import StoreStats
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.requests import Requests
from deployments.scheduler.engine.state_slots import StateSlots
from deployments.scheduler.memory_report import memory_figures_of

INFO_INTERVAL_S = 0.05  # snapshots (counters, histograms) cost a pickle: not one per step under load
DIGEST_INTERVAL_S = 0.25  # the router reads digests every second or so: rebuilding one per step is waste


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


class Snapshots:
    def __init__(
        self,
        fixed: EngineInfo,
        blocks: BlockManager,
        requests: Requests,
        rates: LiveRates,
        counters: EngineCounters,
        disk: DiskStates | None,
        states: StateSlots | None = None,
    ) -> None:
        self.fixed = fixed  # what never changes (the model, the pool, the policy); live figures are filled in
        self.states = states  # hybrid models' state slots (None: an attention-only model)
        self.blocks = blocks
        self.requests = requests  # the counts of running and waiting requests
        self.rates = rates
        self.counters = counters
        self.disk = disk  # None when the store is off
        self._info_at = 0.0  # when the latest info was sent (time.monotonic())
        self._digest_at, self._digest_version = 0.0, (-1, -1)  # the last digest handed to the router
        self._digests = 0

    def info(self) -> EngineInfo:
        return replace(
            self.fixed,
            kv_usage=self.blocks.num_used / self.blocks.num_blocks,
            running=len(self.requests.running),
            waiting=len(self.requests.waiting),
            decode_tokens_per_second=self.rates.decode_rate(),
            prefill_tokens_per_second=self.rates.prefill_rate(),
            counters=self.counters.snapshot(),
            store=None if self.disk is None else self.disk.latest or StoreStats(),
            state_slots_used=0 if self.states is None else self.states.num_used,
            state_snapshots=0 if self.states is None else len(self.states.snapshots),
        )

    def memory_figures(self) -> dict[str, int]:
        """This process's device memory and footprint, sent with each info."""
        return memory_figures_of(self.fixed.device)

    def take(self, out: Stepped, busy: bool) -> None:
        """Fill in the turn's snapshots (`busy`: work is left)."""
        now = time.monotonic()
        finished = any(chunk.finished for chunk in out.chunks)
        if not busy or finished or now - self._info_at >= INFO_INTERVAL_S:
            out.info, out.memory_figures, self._info_at = self.info(), self.memory_figures(), now
        out.digest = self.fresh_digest(force=not busy)

    def fresh_digest(self, force: bool = False) -> PrefixDigest | None:
        """The resident blocks' keys for the router when they changed, at most every DIGEST_INTERVAL_S
        (`force`: whatever the interval, as the engine goes idle); else None."""
        now = time.monotonic()
        version = (self.blocks.version, 0 if self.disk is None else self.disk.version)
        if version == self._digest_version or (not force and now - self._digest_at < DIGEST_INTERVAL_S):
            return None
        self._digest_at, self._digest_version = now, version
        digest = self.blocks.digest()
        digest.version = self._digests = self._digests + 1  # RAM's or the disk's change: a new digest
        if self.disk is not None:  # what the node's disk store holds counts as a partial match
            digest.disk_keys = self.disk.disk_keys()
        return digest


RATE_WINDOW_SECONDS = 2.0
