"""The body of GET /memory and GET /v1/memory: a read-only memory snapshot of every Scheduler replica and
its ranks.

Per replica: the KV pool (blocks total, in use, holding reusable prompt tokens; bytes per block), a hybrid
model's recurrent-state slots (total, held by running requests, kept as snapshots; bytes per slot) and the
process's resident memory; per rank: its weights, KV (of which DSA indexer keys) and state bytes, and where this process holds the device,
CUDA's active/reserved/peak bytes (the same peak `/health?reset_peak=1` restarts).
"""

from typing import Any

from deployments.messages.memory import ReplicaMemory


def memory_body(model: str, replicas: list[ReplicaMemory]) -> dict[str, Any]:
    ordered = sorted(replicas, key=lambda r: r.replica)
    return {
        "object": "memory",
        "model": model,
        "totals": {
            "weights_bytes": sum(rank.weights_bytes for r in ordered for rank in r.ranks),
            "kv_pool_bytes": sum(rank.kv_pool_bytes for r in ordered for rank in r.ranks),
            "kv_index_bytes": sum(rank.kv_index_bytes for r in ordered for rank in r.ranks),
            "kv_used_bytes": sum(r.kv_blocks_used * r.kv_bytes_per_block * len(r.ranks) for r in ordered),
            "prompt_cache_bytes": sum(r.prompt_cache_blocks * r.kv_bytes_per_block * len(r.ranks) for r in ordered),
            "state_pool_bytes": sum(rank.state_pool_bytes for r in ordered for rank in r.ranks),
            "process_rss_bytes": sum(r.process_rss_bytes for r in ordered),
        },
        "replicas": [r.as_json() for r in ordered],
    }
