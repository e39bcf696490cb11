"""The text of GET /metrics and GET /v1/metrics: Prometheus families over every Scheduler replica, read at
scrape time.

Each scrape asks every Scheduler replica for its status and merges them: counters summed, histograms
added bucket-wise (every replica uses the same bounds), running/waiting summed, KV use one `pool` per
replica. Ingress replicas keep no counters of their own (every figure is the engine's), so there is
nothing to merge from them. Each reading is published under its `tensorfold:` name and again under
vLLM's name (same prefix) where vLLM has one, so a vLLM dashboard fills by swapping the prefix. Families
an engine cannot count are left out: the draft families unless an engine drafts, the prefix-cache families
unless the engine keeps prompt blocks across requests.
"""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from deployments.ingress.ops.health import draft_methods, store_summary
from deployments.messages.counters import EngineCounters, RequestHistograms
from deployments.messages.status import ReplicaStatus
from deployments.prompt_store.failures import WRITE_FAILURE_REASONS
from deployments.routing.affinity import ROUTE_REASONS

PREFIX = "tensorfold:"
STORE_COUNTERS = {
    "pieces_written": "Pieces the disk store wrote.",
    "pieces_read": "Pieces the disk store read back (each checked against its hash).",
    "restored_tokens": "Prompt tokens of finished requests read back from the disk store.",
    "damaged_pieces": "Pieces found damaged on read, deleted with the states that needed them.",
    "writes_skipped": "Writes a cap turned away (total size, free disk or the daily cap): RAM only.",
}
# Our histogram name -> (tensorfold name, vLLM's name when it differs, help).
HISTOGRAM_FAMILIES: dict[str, tuple[str, str | None, str]] = {
    "latency": ("request_latency_seconds", "e2e_request_latency_seconds", "Arrival to last token (finished requests)."),
    "ttft": ("time_to_first_token_seconds", None, "Arrival to first reply token."),
    "decode": ("request_decode_seconds", "request_decode_time_seconds", "End of the prompt pass to the last token."),
    "tpot": ("request_time_per_output_token_seconds", None, "Decode time over the reply tokens after the first."),
    "prefill": ("request_prefill_seconds", "request_prefill_time_seconds", "Time in the request's prompt chunks."),
}


def _add_counts(total: dict, counts: dict) -> None:
    for key, count in counts.items():
        total[key] = total.get(key, 0) + count


def merged_counters(replicas: list[ReplicaStatus]) -> EngineCounters:
    """Every replica's counters summed, histograms merged bucket-wise, per-key counts added."""
    total = EngineCounters()
    for replica in replicas:
        counters = replica.counters
        for name, value in vars(counters).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(total, name, getattr(total, name) + value)
        _add_counts(total.requests_by_key, counters.requests_by_key)
        _add_counts(total.requests_by_route, counters.requests_by_route)
        _add_counts(total.accepted_by_position, counters.accepted_by_position)
        total.histograms.merge(counters.histograms)
    return total


class ReplicasCollector(Collector):
    """Builds every family from one read of the replicas' statuses."""

    def __init__(self, model_name: str, replicas: list[ReplicaStatus]) -> None:
        self._model = model_name
        self._replicas = replicas
        self._counters = merged_counters(replicas)

    def collect(self) -> Iterator[Metric]:
        yield from self._gauges()
        yield from self._token_counters()
        yield from self._event_counters()
        yield from self._histograms(self._counters.histograms)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _gauges(self) -> Iterator[Metric]:
        running = sum(r.running for r in self._replicas)
        waiting = sum(r.waiting for r in self._replicas)
        for name in ("requests_running", "num_requests_running"):
            yield self._gauge(name, "Requests holding a decode lane.", running)
        for name in ("requests_waiting", "num_requests_waiting"):
            yield self._gauge(name, "Requests waiting for a lane.", waiting)
        counters = self._counters
        in_flight = counters.completion_tokens_total - counters.generation_tokens_total
        yield self._gauge("generation_tokens_running", "Reply tokens of requests still running.", in_flight)
        footprint = sum(r.memory.get("footprint", 0) for r in self._replicas)
        yield self._gauge(
            "process_footprint_bytes",
            "Memory footprint of the engine processes (phys_footprint on "
            "macOS, MLX's unified memory included; resident set elsewhere).",
            footprint,
        )
        for name in ("kv_cache_usage_ratio", "kv_cache_usage_perc"):
            family = GaugeMetricFamily(
                PREFIX + name, "KV blocks in use over the pool (0-1), per replica pool.", labels=["model_name", "pool"]
            )
            for replica in self._replicas:
                family.add_metric([self._model, replica.replica], replica.kv_usage)
            yield family

    def _token_counters(self) -> Iterator[Metric]:
        counters = self._counters
        yield self._counter("prompt_tokens", "Prompt tokens of finished requests.", counters.prompt_tokens_total)
        yield self._counter("generation_tokens", "Reply tokens of finished requests.", counters.generation_tokens_total)
        if not all(r.prompt_cache for r in self._replicas):
            return  # an engine that keeps no prompt blocks cannot report cache hits honestly
        cached = counters.cached_tokens_total
        yield self._counter("prompt_tokens_cached", "Prompt tokens of finished requests found cached.", cached)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", cached)
        yield self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", counters.prompt_tokens_total
        )

    def _event_counters(self) -> Iterator[Metric]:
        counters = self._counters
        family = CounterMetricFamily(
            PREFIX + "requests", "Finished requests, by API-key label.", labels=["model_name", "key"]
        )
        for key, count in sorted(counters.requests_by_key.items()):
            family.add_metric([self._model, key], count)
        yield family
        yield self._counter(
            "client_disconnections", "Requests the client walked away from.", counters.requests_aborted_total
        )
        for name in ("preemptions", "num_preemptions"):
            yield self._counter(name, "Requests that gave up their lane to another.", counters.preemptions_total)
        yield self._counter("decode_rounds", "Decode rounds run.", counters.rounds_total)
        yield self._routing_decisions()
        yield from self._drafts()
        yield from self._store()

    def _drafts(self) -> Iterator[Metric]:
        """Draft tokens verified and kept on finished requests, under our names and vLLM's, while an engine drafts."""
        if not draft_methods(self._replicas):
            return
        counters = self._counters
        for name in ("mtp_drafted", "spec_decode_num_draft_tokens"):
            yield self._counter(name, "Draft tokens verified (finished requests).", counters.drafted_total)
        for name in ("mtp_accepted", "spec_decode_num_accepted_tokens"):
            yield self._counter(name, "Draft tokens kept (equal to the draw at their row).", counters.accepted_total)
        yield self._counter("spec_decode_num_drafts", "Verify rounds that carried drafts.", counters.draft_rounds_total)
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept, by their position in the round's drafts.",
            labels=["model_name", "position"],
        )
        for position, count in sorted(counters.accepted_by_position.items()):
            family.add_metric([self._model, str(position)], count)
        yield family

    def _store(self) -> Iterator[Metric]:
        """The disk prompt-state store's families, only while it is on."""
        store = store_summary(self._replicas)
        if store is None:
            return
        yield self._gauge("store_bytes", "Bytes the disk store holds for this model and build.", store["bytes_held"])
        yield self._gauge(
            "store_available", "1 while the disk store answers, 0 while its actor restarts.", store["available"]
        )
        for name, doc in STORE_COUNTERS.items():
            yield self._counter(f"store_{name}", doc, store[name])
        family = CounterMetricFamily(
            PREFIX + "store_write_failures",
            "Writes that failed, by reason: no_space, permission, io_error, unavailable (the actor was down).",
            labels=["model_name", "reason"],
        )
        for reason in WRITE_FAILURE_REASONS:
            family.add_metric([self._model, reason], store["write_failures"].get(reason, 0))
        yield family

    def _routing_decisions(self) -> Metric:
        """Finished requests by the prefix-affinity router's reason (all zero when Serve's router chose)."""
        family = CounterMetricFamily(
            PREFIX + "routing_decisions", "Requests routed, by the router's reason.", labels=["model_name", "reason"]
        )
        counts = {reason: 0 for reason in ROUTE_REASONS} | self._counters.requests_by_route
        for reason, count in sorted(counts.items()):
            family.add_metric([self._model, reason], count)
        return family

    def _histograms(self, merged: RequestHistograms) -> Iterator[Metric]:
        for key, (name, vllm_name, doc) in HISTOGRAM_FAMILIES.items():
            histogram = merged.histograms[key]
            for family_name in filter(None, (name, vllm_name)):
                family = HistogramMetricFamily(PREFIX + family_name, doc, labels=["model_name"])
                family.add_metric([self._model], buckets=histogram.cumulative(), sum_value=histogram.total)
                yield family


def exposition(model_name: str, replicas: list[ReplicaStatus]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicasCollector(model_name, replicas))
    return generate_latest(registry)
