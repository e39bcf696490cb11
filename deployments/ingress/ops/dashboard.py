"""`--dashboard`: the JSON snapshot GET /stats answers (GET /dashboard's page, dashboard_page.py, polls it).

Both answer 404 in the route's error format when the flag is off. The page polls /stats once a second,
so its access-log lines are dropped from Serve's replica log (a filter on the `ray.serve` logger) to
keep the log about requests.
"""

import logging
import time
from typing import Any

from deployments.ingress.ops.health import draft_methods, store_summary
from deployments.ingress.ops.metrics import merged_counters
from deployments.messages.counters import EngineCounters, Histogram
from deployments.messages.status import ReplicaStatus

QUIET_ROUTES = ("/stats",)


class QuietPollFilter(logging.Filter):
    """Drops Serve's access-log records for the dashboard's poll (every other record passes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "serve_access_log", False):
            return True
        route = str(getattr(record, "route", "") or "")
        message = record.getMessage()
        return not any(route.endswith(path) or f" {path} " in message for path in QUIET_ROUTES)


def install_quiet_poll_filter() -> None:
    logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, QuietPollFilter) for f in logger.filters):
        logger.addFilter(QuietPollFilter())


def _histogram_json(histogram: Histogram) -> dict[str, Any]:
    return {
        "bounds": list(histogram.bounds),
        "counts": list(histogram.counts),
        "count": histogram.count,
        "sum": round(histogram.total, 6),
        "p50": histogram.quantile(0.5),
        "p90": histogram.quantile(0.9),
        "p99": histogram.quantile(0.99),
    }


def _replica_json(replica: ReplicaStatus) -> dict[str, Any]:
    counters = replica.counters
    return {
        "replica": replica.replica,
        "running": replica.running,
        "waiting": replica.waiting,
        "kv_usage": round(replica.kv_usage, 4),
        "decode_tokens_per_second": replica.decode_tokens_per_second,
        "prefill_tokens_per_second": replica.prefill_tokens_per_second,
        "requests_total": counters.requests_total,
        "completion_tokens_total": counters.completion_tokens_total,
    }


def stats_snapshot(model: str, replicas: list[ReplicaStatus]) -> dict[str, Any]:
    """What the dashboard draws: totals to difference into rates, live gauges, distributions, replicas."""
    counters = merged_counters(replicas)
    ordered = sorted(replicas, key=lambda r: r.replica)
    return {
        "time": time.time(),
        "model": model,
        "live": {
            "running": sum(r.running for r in replicas),
            "waiting": sum(r.waiting for r in replicas),
            "decode_tokens_per_second": round(sum(r.decode_tokens_per_second for r in replicas), 1),
            "prefill_tokens_per_second": round(sum(r.prefill_tokens_per_second for r in replicas), 1),
        },
        "totals": {
            "requests_total": counters.requests_total,
            "prompt_tokens_total": counters.prompt_tokens_total,
            "generation_tokens_total": counters.generation_tokens_total,
            "completion_tokens_total": counters.completion_tokens_total,
            "cached_tokens_total": counters.cached_tokens_total,
            "client_disconnections_total": counters.requests_aborted_total,
            "preemptions_total": counters.preemptions_total,
            "decode_rounds_total": counters.rounds_total,
        },
        "histograms": {name: _histogram_json(h) for name, h in counters.histograms.histograms.items()},
        "replicas": [_replica_json(r) for r in ordered],
        "store": store_summary(replicas),  # the disk prompt-state store's figures; null when it is off
        "drafts": _drafts_json(replicas, counters),  # null when no engine drafts
    }


def _drafts_json(replicas: list[ReplicaStatus], counters: EngineCounters) -> dict[str, Any] | None:
    methods = draft_methods(replicas)
    if not methods:
        return None
    drafted, accepted = counters.drafted_total, counters.accepted_total
    return {
        "method": ",".join(methods),
        "drafted_total": drafted,
        "accepted_total": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
    }
