"""Each deployment's own configuration model, shared by the app builder, the CLI and the tests."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """What a Scheduler replica needs to open its engine (built from `AppArgs` or directly in tests)."""

    model_config = ConfigDict(extra="forbid")

    model: str  # checkpoint directory
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto = the checkpoint's
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # What computes the forward pass: auto = MLX on an Apple-silicon Mac where mlx imports, torch elsewhere.
    backend: Literal["auto", "torch", "mlx"] = "auto"
    context: int | None = Field(default=None, ge=16)  # window cap; None = the model's
    parallel: int | Literal["auto"] = "auto"  # concurrent sequences; auto = sized from memory
    block_size: int = Field(default=16, ge=1)
    prefill_chunk_size: int = Field(default=512, ge=1)
    decode_share: float = Field(default=0.25, ge=0.0, le=1.0)
    prompt_cache_gib: float | None = Field(default=None, ge=0.0)  # None = no extra cap; 0 = no reuse across requests
    kv_cache_gib: float | None = Field(default=None, gt=0.0)  # explicit KV pool size instead of free memory
    default_max_tokens: int | None = Field(default=None, ge=1)  # reply limit when a request omits one
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_parallel_auto: int = Field(default=64, ge=1)  # ceiling of `parallel: auto`
    # Least time between two chunks of one reply leaving the Scheduler: the first and last go at once, and
    # tokens drawn in between ride together, so a busy replica sends fewer, fuller items over Ray.
    stream_interval_ms: float = Field(default=0.0, ge=0.0, le=1000.0)
    # Chunks per second all of a replica's streams may send together (0 = no cap): under load each reply's
    # interval stretches to streams / this, bounding what the hops downstream spend per token.
    stream_events_per_second: float = Field(default=0.0, ge=0.0)
    # At tensor-parallel size 1, step the engine in a child process of the Scheduler replica rather than on
    # a thread of it, so the replica's own Python work (requests, streamed chunks) never holds its GIL.
    engine_process: bool = False
    # Intra-op threads of the forward pass (None: the node's cores less `reserved_cpus`, split between the
    # node's tensor-parallel ranks; deployments/model_rank/threads.py), never Ray's OMP_NUM_THREADS.
    engine_threads: int | None = Field(default=None, ge=1)
    reserved_cpus: float = Field(default=0.0, ge=0.0)  # CPUs the graph's other replicas on the node need
    # The disk prompt-state store (deployments/prompt_store): every state kept in RAM also goes to disk, and
    # a prompt continuing past RAM's state resumes from disk when reading beats prefilling.
    learn: bool = False  # shared prefixes only (blocks a later request found cached), in a store of their own
    learn_conversations: bool = False  # every state kept in RAM (implies learn, in place of its store)
    learn_dir: str = "~/.cache/tensorfold/learned"
    learn_gib: float = Field(default=32.0, gt=0.0)  # every model's sets together
    learn_min_free_gib: float = Field(default=4.0, ge=0.0)
    learn_daily_gib: float = Field(default=32.0, gt=0.0)

    # Drafts: several tokens per round, every reply the same as serial decoding's. auto = the checkpoint's MTP
    # layer where it has one, else n-gram lookup; draft_tokens caps the drafts per round (None: the method's).
    draft: Literal["auto", "mtp", "ngram", "off"] = "auto"
    draft_tokens: int | None = Field(default=None, ge=1, le=16)
    # measured: each round's lengths from acceptance and step cost (0 when drafting does not pay); fixed:
    # every round drafts draft_tokens where the proposal and the limit allow (reproducible draft counts).
    draft_policy: Literal["measured", "fixed"] = "measured"

    @property
    def wants_mtp(self) -> bool:
        """Whether the ranks should load the MTP layer's drafting (it runs only where the checkpoint has one)."""
        return self.draft in ("auto", "mtp")

    @property
    def learning(self) -> bool:
        return self.learn or self.learn_conversations


class StartupError(ValueError):
    """The engine cannot open (too little memory, bad settings); the message says what to change."""
