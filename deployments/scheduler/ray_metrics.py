"""The engine's readings through Ray Serve's metrics API, so they show in Ray's dashboard and its
Prometheus export (as `ray_tensorfold_*`, tagged with the application, deployment and replica).

Histograms are observed per finished request from the last chunk's stats (exact values); counters and
gauges follow the engine's snapshot once a second on a daemon thread, counters by their increase.
Ray's names cannot hold ':' so they use `tensorfold_` where /metrics uses `tensorfold:`.
"""

import logging
import threading
from collections.abc import Callable
from typing import Any

from deployments.messages.counters import HISTOGRAMS, EngineCounters, RequestTimings
from deployments.messages.replies import EngineChunk

log = logging.getLogger("tensorfold.metrics")
SYNC_SECONDS = 1.0
COUNTERS = {  # Ray name -> EngineCounters field
    "tensorfold_prompt_tokens_total": "prompt_tokens_total",
    "tensorfold_generation_tokens_total": "generation_tokens_total",
    "tensorfold_prompt_tokens_cached_total": "cached_tokens_total",
    "tensorfold_client_disconnections_total": "requests_aborted_total",
    "tensorfold_preemptions_total": "preemptions_total",
    "tensorfold_decode_rounds_total": "rounds_total",
}
HISTOGRAM_NAMES = {
    "latency": "tensorfold_request_latency_seconds",
    "ttft": "tensorfold_time_to_first_token_seconds",
    "decode": "tensorfold_request_decode_seconds",
    "tpot": "tensorfold_request_time_per_output_token_seconds",
    "prefill": "tensorfold_request_prefill_seconds",
}


class RayMetricsExport:
    def __init__(self, read_info: Callable[[], Any]) -> None:
        from ray.serve import metrics

        self._read_info = read_info
        self._counters = {
            name: metrics.Counter(name, description=f"engine {field}") for name, field in COUNTERS.items()
        }
        self._requests = metrics.Counter(
            "tensorfold_requests_total", description="finished requests", tag_keys=("key",)
        )
        gauges = (
            "tensorfold_requests_running",
            "tensorfold_requests_waiting",
            "tensorfold_kv_cache_usage_ratio",
            "tensorfold_generation_tokens_running",
        )
        self._gauges = {name: metrics.Gauge(name, description=name) for name in gauges}
        self._histograms = {
            key: metrics.Histogram(name, description=name, boundaries=list(HISTOGRAMS[key]))
            for key, name in HISTOGRAM_NAMES.items()
        }
        self._last = EngineCounters()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorfold-ray-metrics", daemon=True)
        self._thread.start()

    def observe(self, item: object) -> None:
        """A finished request's timings into the histograms (other items pass by)."""
        if not isinstance(item, EngineChunk) or item.stats is None or item.finish_reason is None:
            return
        for key, value in RequestTimings.of(item.stats, item.finish_reason).items():
            self._histograms[key].observe(value)

    def stop(self) -> None:
        self._stopping.set()

    def _run(self) -> None:
        while not self._stopping.wait(SYNC_SECONDS):
            try:
                self.sync(self._read_info())
            except Exception:  # metrics must never take the replica down
                log.exception("exporting metrics to Ray failed")

    def sync(self, info: Any) -> None:
        counters: EngineCounters = info.counters
        for name, field in COUNTERS.items():
            increase = getattr(counters, field) - getattr(self._last, field)
            if increase > 0:
                self._counters[name].inc(increase)
        for key, count in counters.requests_by_key.items():
            increase = count - self._last.requests_by_key.get(key, 0)
            if increase > 0:
                self._requests.inc(increase, tags={"key": key})
        self._gauges["tensorfold_requests_running"].set(info.running)
        self._gauges["tensorfold_requests_waiting"].set(info.waiting)
        self._gauges["tensorfold_kv_cache_usage_ratio"].set(info.kv_usage)
        in_flight = counters.completion_tokens_total - counters.generation_tokens_total
        self._gauges["tensorfold_generation_tokens_running"].set(in_flight)
        self._last = counters
