"""The /health body: the fields docs/api.md lists, in its order, summed over every Scheduler replica.

After the native fields come the Python CUDA server's counters, which a poller differences into rates
(requests_total, token and time totals, rounds), and `context_length`, the served window. While the
model loads, the body (answered with 503, as llama.cpp answers its loading state) keeps the fields known
before any replica answers, with status "loading" and warming true.
"""

from typing import Any

from deployments.ingress.context import IngressSettings
from deployments.messages.status import ReplicaStatus
from deployments.prompt_store.failures import UNAVAILABLE


def _sum_memory(replicas: list[ReplicaStatus]) -> dict[str, int]:
    """CUDA's or MLX's active, cache and peak bytes, summed ({} where no replica computes on either)."""
    keys = ("active", "cache", "peak")
    if not any("active" in r.memory for r in replicas):
        return {}
    return {key: sum(r.memory.get(key, 0) for r in replicas) for key in keys}


def _live(replicas: list[ReplicaStatus]) -> dict[str, Any]:
    running = sum(r.running for r in replicas)
    waiting = sum(r.waiting for r in replicas)
    return {
        "connections": running + waiting,
        "waiting": waiting,
        "decode_tokens_per_second": round(sum(r.decode_tokens_per_second for r in replicas), 1),
        "prefill_tokens_per_second": round(sum(r.prefill_tokens_per_second for r in replicas), 1),
    }


def draft_methods(replicas: list[ReplicaStatus]) -> list[str]:
    """The drafters the replicas' engines run ([]: none drafts, so no draft figure is reported)."""
    return sorted({r.drafts for r in replicas} - {"off"})


def _counters(replicas: list[ReplicaStatus]) -> dict[str, Any]:
    def total(name: str) -> Any:
        return sum(getattr(r.counters, name) for r in replicas)

    running = sum(r.running for r in replicas)
    drafting = draft_methods(replicas)
    drafts: dict[str, Any] = (
        {}
        if not drafting
        else {
            "drafts": ",".join(drafting),
            "draft_tokens": max(r.draft_tokens for r in replicas),
            "drafted_total": total("drafted_total"),
            "accepted_total": total("accepted_total"),
        }
    )
    return drafts | {
        "busy": running > 0,
        "requests_running": running,
        "requests_total": total("requests_total"),
        "completion_tokens_total": total("completion_tokens_total"),
        "prompt_tokens_total": total("prompt_tokens_total"),
        "cached_tokens_total": total("cached_tokens_total"),
        "prefill_seconds_total": round(total("prefill_seconds_total"), 6),
        "decode_seconds_total": round(total("decode_seconds_total"), 6),
        "rounds_total": total("rounds_total"),
        "context_length": min(r.window for r in replicas),
        "replicas": len(replicas),
    }


def loading_body(settings: IngressSettings, minimal: bool) -> dict[str, Any]:
    """The body while no Scheduler replica has answered yet: the model is still loading."""
    if minimal:  # keys configured: the status alone
        return {"status": "loading"}
    return {
        "status": "loading",
        "model": settings.served_name,
        "model_ids": list(settings.model_ids),
        "warming": True,
        "version": settings.version,
        "message": "Loading model",
    }


def health_body(settings: IngressSettings, replicas: list[ReplicaStatus], vision: bool = False) -> dict[str, Any]:
    """`vision`: the Renderer reads image parts (--vision on a model with a vision tower)."""
    first = replicas[0]
    body: dict[str, Any] = {
        "status": "ok",
        "model": settings.served_name,
        "model_ids": list(settings.model_ids),
        "max_batch_size": sum(r.lanes for r in replicas),
        "vision": vision,
    }
    if first.policy:
        body["policy"] = first.policy
    if first.weights_format:
        body["weights"] = {"format": first.weights_format, "bytes": first.weights_bytes}
    body["warming"] = False
    body["memory"] = _sum_memory(replicas)
    body["live"] = _live(replicas)
    body["version"] = settings.version
    if first.device.startswith(("cuda", "mlx")):
        body["backend"] = first.device.split("-")[0]
        if first.device_name:
            body["device"] = first.device_name
    body.update(_counters(replicas))
    store = store_summary(replicas)
    if store is not None:
        body["store"] = store
    if any(r.state_slots for r in replicas):  # a hybrid model: its recurrent-state slots
        body["state_slots"] = {
            "total": sum(r.state_slots for r in replicas),
            "used": sum(r.state_slots_used for r in replicas),
            "snapshots": sum(r.state_snapshots for r in replicas),
        }
    return body


def store_summary(replicas: list[ReplicaStatus]) -> dict[str, Any] | None:
    """The disk store's figures (None when it is off). Replicas on one node share a store, so each figure
    is the largest any replica reports; restored tokens and writes lost to an unavailable actor are each
    replica's own and add up. `available` is false, with the reason, while any replica's store is not."""
    stores = [r.store for r in replicas if r.store is not None]
    if not stores:
        return None
    summary: dict[str, Any] = {
        name: max(getattr(s, name) for s in stores)
        for name, value in vars(stores[0]).items()
        if isinstance(value, int) and not isinstance(value, bool)
    }
    summary["restored_tokens"] = sum(r.counters.disk_tokens_total for r in replicas)
    failures: dict[str, int] = {}
    for store in stores:
        for reason, count in store.write_failures.items():
            failures[reason] = (
                failures.get(reason, 0) + count if reason == UNAVAILABLE else max(failures.get(reason, 0), count)
            )
    summary["write_failures"] = dict(sorted(failures.items()))
    down = [s for s in stores if not s.available]
    summary["available"] = not down
    if down:
        summary["unavailable_reason"] = down[0].unavailable_reason
    return summary
