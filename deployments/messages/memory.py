"""Memory as the ranks measure it: each rank's reading for the engine's planning, and a Scheduler replica's
snapshot for GET /memory, per replica and per rank (read by Ingress)."""

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MemoryReading:
    """What one rank measured of the memory its device offers (docs/engine.md, Memory): the engine sizes
    its pool from every rank's reading and never reads a device itself."""

    available_bytes: int  # what the pool may come out of, before the reserve
    total_bytes: int
    unified: bool  # host memory (CPU, or a GPU sharing RAM): the reserve rule differs, a host's ranks share it
    host: str = ""  # the node the rank runs on
    device: str = "cpu"  # what was read: "cuda:0", "cpu", "mlx"


@dataclass
class DeviceMemory:
    """CUDA memory of this process: torch's allocated bytes, reserved bytes, the peak and the card's total."""

    name: str
    active_bytes: int
    reserved_bytes: int
    peak_bytes: int
    free_bytes: int
    total_bytes: int


@dataclass
class MlxMemory:
    """An MLX rank's memory (the figures docs/mlx.md lists), read in the rank's process."""

    active_bytes: int  # MLX's arrays now
    cache_bytes: int  # freed buffers MLX keeps for reuse
    peak_bytes: int
    budget_bytes: int  # what the KV pool was sized from: unified memory less the weights and the reserve
    mlx_budget_bytes: int  # MLX's own allocation limit (mx.get_memory_limit)
    footprint_bytes: int  # the process's footprint (phys_footprint on macOS, else its resident set)


@dataclass
class RankMemory:
    rank: int
    weights_bytes: int  # this rank's shard of the weights
    kv_pool_bytes: int  # this rank's KV tensors
    kv_index_bytes: int = 0  # of kv_pool_bytes: DSA indexers' keys beside the latents (GLM-5.3 families)
    state_pool_bytes: int = 0  # this rank's recurrent-state slots (hybrid models)
    process_rss_bytes: int | None = None  # only for the rank running in this replica's process
    device: DeviceMemory | None = None
    mlx: MlxMemory | None = None  # only for an MLX rank
    weights_format: str = ""  # a dtype, or a GGUF's block types and whether they are kept (docs/gguf.md)


@dataclass
class ReplicaMemory:
    replica: str
    block_size: int
    kv_blocks_total: int
    kv_blocks_used: int  # referenced by a running request
    prompt_cache_blocks: int  # blocks holding named prompt tokens (reusable by a later prompt)
    kv_bytes_per_block: int  # per rank
    process_rss_bytes: int
    ranks: list[RankMemory] = field(default_factory=list)
    # Hybrid models (0 otherwise): recurrent-state slots per rank, their size, held by running requests, kept
    # as prefix-cache snapshots.
    state_slots_total: int = 0
    state_bytes_per_slot: int = 0
    state_slots_used: int = 0
    state_snapshots: int = 0

    def as_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)
