"""What crosses the Ray boundary between Ingress and a Scheduler replica, besides EngineRequest/EngineChunk.

Kept free of torch and the engine's modules so Ingress can unpickle these without importing the model
code. A stream's items are its chunks, or a `Refusal` as its only item: Ingress answers a refusal
before it opens any stream.
"""

from dataclasses import dataclass, field

from deployments.messages.counters import EngineCounters
from deployments.messages.replies import EngineChunk, Refusal
from deployments.messages.store import StoreStats

UpstreamItem = EngineChunk | Refusal


@dataclass
class EngineInfo:
    """A snapshot for /health, /metrics and the finish log (read on any thread)."""

    window: int
    lanes: int
    policy: str
    block_size: int
    num_blocks: int
    kv_usage: float
    running: int
    waiting: int
    decode_tokens_per_second: float
    prefill_tokens_per_second: float
    dtype: str
    device: str
    device_name: str
    model_type: str
    counters: EngineCounters
    prompt_cache: bool = True  # whether prompt blocks are kept for reuse across requests
    store: StoreStats | None = None  # the disk store's figures for this replica's set (None: the store is off)
    drafts: str = "off"  # the engine's drafter: "mtp", "ngram" or "off" (then the draft families are left out)
    draft_tokens: int = 0  # the most drafts a round verifies per sequence
    # Hybrid models (0 otherwise): recurrent-state slots in all, those running sequences hold, snapshots kept.
    state_slots: int = 0
    state_slots_used: int = 0
    state_snapshots: int = 0
    weights_format: str = ""  # a dtype, or a GGUF's block types and whether they are kept (docs/gguf.md)
    weights_bytes: int = 0  # one model copy's weights, all ranks together


@dataclass
class ReplicaStatus(EngineInfo):
    """One Scheduler replica's snapshot for /health and the runtime block (summed over replicas by Ingress)."""

    replica: str = ""  # Serve's replica id, so a caller can tell the model copies apart
    # CUDA's or MLX's active, cache and peak bytes (absent elsewhere), and the engine process's footprint
    memory: dict[str, int] = field(default_factory=dict)
    # Whether this replica's engine takes a request now; when not, `unavailable` says why ("the engine
    # process exited", "the server is shutting down") and /health answers 503 with it.
    serving: bool = True
    unavailable: str = ""
