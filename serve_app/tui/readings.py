"""What `tensorfold tui` shows, read from a server's `/health`, `/metrics` and (with `--dashboard`) `/stats`.

Pure functions over the bodies, so the screens can be tested on fixed readings. With keys configured
`/health` says only `{"status": "ok"}`; the figures then come from `/metrics` (and `/stats`), which take the
key (docs/tui.md).
"""

import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "tensorfold:"


@dataclass
class ReplicaReading:
    """One Scheduler replica (a model copy), as `/stats` or `/metrics` report it."""

    name: str
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # KV blocks in use over the pool, 0-1
    decode_tokens_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0


@dataclass
class Readings:
    """One poll of a server. `state` says which screen to show; the figures are None where unknown."""

    state: str  # "serving", "loading", "unauthorized", "unreachable" or "error"
    message: str = ""  # why, for every state but "serving"
    model: str = ""
    policy: str = ""
    context_length: int | None = None
    running: int | None = None
    waiting: int | None = None
    decode_tokens_per_second: float | None = None
    prefill_tokens_per_second: float | None = None
    requests_total: int | None = None
    ttft_p50: float | None = None  # seconds
    ttft_p99: float | None = None
    latency_p50: float | None = None
    latency_p99: float | None = None
    kv_usage: float | None = None  # the fullest replica's pool, 0-1
    draft_acceptance: float | None = None  # accepted over drafted tokens; None while no engine drafts
    store: dict[str, Any] | None = None  # the disk store's figures; None while it is off
    routing: dict[str, int] = field(default_factory=dict)  # requests by the router's reason
    replicas: list[ReplicaReading] = field(default_factory=list)


def from_bodies(health: dict[str, Any], metrics: str | None, stats: dict[str, Any] | None) -> Readings:
    """A serving server's readings: /stats where it answered, then /metrics, then /health's own fields."""
    readings = Readings(state="serving", model=str(health.get("model", "")), policy=str(health.get("policy", "")))
    readings.context_length = health.get("context_length")
    _from_health(readings, health)
    if metrics is not None:
        _from_metrics(readings, metrics)
    if stats is not None:
        _from_stats(readings, stats)
    return readings


def _from_health(readings: Readings, health: dict[str, Any]) -> None:
    live = health.get("live") or {}
    readings.running = health.get("requests_running")
    readings.waiting = live.get("waiting")
    readings.decode_tokens_per_second = live.get("decode_tokens_per_second")
    readings.prefill_tokens_per_second = live.get("prefill_tokens_per_second")
    readings.requests_total = health.get("requests_total")
    readings.store = health.get("store")
    drafted = health.get("drafted_total")
    if drafted:
        readings.draft_acceptance = health.get("accepted_total", 0) / drafted


def _from_metrics(readings: Readings, text: str) -> None:
    families = {f.name.removeprefix(PREFIX): f for f in text_string_to_metric_families(text)}
    if "requests_running" in families:
        readings.running = int(_total(families["requests_running"]))
    if "requests_waiting" in families:
        readings.waiting = int(_total(families["requests_waiting"]))
    if "requests" in families:
        readings.requests_total = int(_total(families["requests"], "_total"))
    pools = {s.labels.get("pool", ""): s.value for s in _samples(families.get("kv_cache_usage_ratio"))}
    if pools:
        readings.kv_usage = max(pools.values())
        readings.replicas = readings.replicas or [ReplicaReading(name, kv_usage=v) for name, v in sorted(pools.items())]
    readings.ttft_p50, readings.ttft_p99 = _quantiles(families.get("time_to_first_token_seconds"))
    readings.latency_p50, readings.latency_p99 = _quantiles(families.get("request_latency_seconds"))
    drafted, accepted = families.get("spec_decode_num_draft_tokens"), families.get("spec_decode_num_accepted_tokens")
    if drafted is not None and accepted is not None and _total(drafted, "_total"):
        readings.draft_acceptance = _total(accepted, "_total") / _total(drafted, "_total")
    readings.routing = {
        s.labels["reason"]: int(s.value)
        for s in _samples(families.get("routing_decisions"))
        if s.name.endswith("_total") and s.value
    }


def _from_stats(readings: Readings, stats: dict[str, Any]) -> None:
    live = stats.get("live") or {}
    readings.running, readings.waiting = live.get("running"), live.get("waiting")
    readings.decode_tokens_per_second = live.get("decode_tokens_per_second")
    readings.prefill_tokens_per_second = live.get("prefill_tokens_per_second")
    readings.store = stats.get("store") or readings.store
    readings.replicas = [
        ReplicaReading(
            name=str(r["replica"]),
            running=r["running"],
            waiting=r["waiting"],
            kv_usage=r["kv_usage"],
            decode_tokens_per_second=r["decode_tokens_per_second"],
            prefill_tokens_per_second=r["prefill_tokens_per_second"],
        )
        for r in stats.get("replicas", [])
    ]


def _samples(family: Any) -> list[Any]:
    return list(family.samples) if family is not None else []


def _total(family: Any, suffix: str = "") -> float:
    return sum(s.value for s in family.samples if s.name.endswith(suffix))


def _quantiles(family: Any) -> tuple[float | None, float | None]:
    """p50 and p99 of a Prometheus histogram, interpolated inside the bucket that holds them."""
    buckets = sorted(
        (float(s.labels["le"]), s.value) for s in _samples(family) if s.name.endswith("_bucket") and "le" in s.labels
    )
    if not buckets or buckets[-1][1] == 0:
        return None, None
    return _quantile(buckets, 0.5), _quantile(buckets, 0.99)


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # past the last finite bound: its edge is all that is known
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound
