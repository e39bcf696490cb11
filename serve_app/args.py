"""The one schema of the app's arguments: the Serve config's `args`, and what `tensorfold serve` builds.

`serve run configs/*.yaml` hands the YAML's `args` mapping to `build_app`, whose single parameter is
annotated with `AppArgs`, so Serve validates it here; `tensorfold serve MODEL --flags` builds the same
model from the command line. Unknown keys are errors that name the key (extra="forbid").
"""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.config import EngineConfig

BUILTIN_PREFIX = "builtin:"
BUILTIN_ROOT = Path(__file__).resolve().parent / "builtin"
DEFAULT_MODEL = "builtin:tiny-glm"
# A served reply's chunks leave its Scheduler at most once per interval (the first and last at once). The
# floor is 0, so a lone stream gets every token as drawn; under load all of a replica's streams together
# send at most STREAM_EVENTS_PER_SECOND chunks, so each hop's per-chunk cost stays bounded (README, Benchmarks).
STREAM_INTERVAL_MS = 0.0
STREAM_EVENTS_PER_SECOND = 200.0


def resolve_model_dir(model: str) -> Path:
    """`builtin:NAME` names a checkpoint shipped inside the package; anything else is a directory path."""
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX) :]
        available = sorted(p.name for p in BUILTIN_ROOT.iterdir() if p.is_dir()) if BUILTIN_ROOT.is_dir() else []
        if not name or name not in available:
            raise ValueError(f"unknown builtin model {model!r} (available: {', '.join(available) or 'none'})")
        return BUILTIN_ROOT / name
    path = Path(model).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"model {model!r}: no checkpoint directory at {path}")
    return path


class AppArgs(BaseModel):
    """Everything that shapes one served model: the engine, the HTTP surface and the graph's layout."""

    model_config = ConfigDict(extra="forbid")

    # What is served and under which names.
    model: str = DEFAULT_MODEL  # a checkpoint directory, or builtin:tiny-glm
    name: str | None = None  # the served model id; default: the checkpoint directory's name
    aliases: list[str] = Field(default_factory=list)  # extra ids /v1/models lists and requests may use

    # HTTP binding. `tensorfold serve` uses these; under `serve run` the YAML's http_options decide.
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    # Who answers HTTP: "ingress" = the Ingress replica itself (Serve's direct ingress; its controller must
    # have the settings too: configs/glm.yaml's controller_options, or `tensorfold serve`), or Serve's proxy.
    http_entry: Literal["ingress", "proxy"] = "proxy"

    # Keys (deployments.ingress.http.keys): added to TENSORFOLD_API_KEY's; prefer a 0600 api_key_file.
    api_keys: list[str] = Field(default_factory=list, repr=False)  # never printed with the args
    api_key_file: str | None = None
    metrics_open: bool = False  # /metrics and /v1/metrics without a key
    max_body_bytes: int = Field(default=16 << 20, ge=1024)  # larger request bodies get HTTP 413
    dashboard: bool = False  # GET /dashboard (live page) and GET /stats (its JSON snapshot)
    ready_wait_s: float = Field(default=60.0, ge=0.0)  # a request sent while the model loads waits this long

    # The engine (see deployments.config.EngineConfig for each knob's meaning).
    context: int | None = Field(default=None, ge=16)
    parallel: int | Literal["auto"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when the Ray cluster has GPUs
    backend: Literal["auto", "torch", "mlx"] = "auto"  # auto: MLX on an Apple-silicon Mac, torch elsewhere
    block_size: int = Field(default=16, ge=1)
    prefill_chunk_size: int = Field(default=512, ge=1)
    decode_share: float = Field(default=0.25, ge=0.0, le=1.0)
    prompt_cache_gib: float | None = Field(default=None, ge=0.0)
    kv_cache_gib: float | None = Field(default=None, gt=0.0)
    default_max_tokens: int | None = Field(default=None, ge=1)
    stream_interval_ms: float = Field(default=STREAM_INTERVAL_MS, ge=0.0, le=1000.0)
    stream_events_per_second: float = Field(default=STREAM_EVENTS_PER_SECOND, ge=0.0)
    engine_process: bool = True
    engine_threads: int | None = Field(default=None, ge=1)  # None: the node's cores less Ingress's and the Renderer's
    # Drafts (deployments/scheduler/engine/drafts.py): auto = the checkpoint's MTP layer, else n-gram prompt lookup.
    # Replies are the same as `draft: false` ones, token for token; draft_tokens caps drafts per round.
    draft: Literal["auto", "mtp", "ngram", "off"] = "auto"
    draft_tokens: int | None = Field(default=None, ge=1, le=16)
    draft_policy: Literal["measured", "fixed"] = "measured"  # fixed: always draft_tokens (no cost model)

    # The disk prompt-state store (deployments/prompt_store): every state the engine keeps in RAM also goes
    # to disk, and a conversation resumes from there after a restart or an eviction from RAM.
    learn: bool = False  # shared prefixes only (what a later request found cached), in a store of their own
    learn_conversations: bool = False  # implies learn: every state, in the store that takes learn's place
    learn_dir: str = "~/.cache/tensorfold/learned"
    learn_gib: float = Field(default=32.0, gt=0.0)  # every model's sets together
    learn_min_free_gib: float = Field(default=4.0, ge=0.0)  # past it, states stay in RAM only
    learn_daily_gib: float = Field(default=32.0, gt=0.0)  # written per day; past it, states stay in RAM only

    # Chat rendering and thinking (deployments.renderer, deployments.scheduler.engine.thinking).
    chat_template: str | None = None  # a UTF-8 Jinja file replacing the checkpoint's template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking_budget: int = Field(default=0, ge=0)  # requests without a budget get this one; 0 = none
    loop_guard: bool = False  # close a think block stuck in a short exact cycle

    # The graph: model copies, ranks per copy and how the ranks are placed.
    tensor_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int = Field(default=1, ge=1)
    placement_strategy: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    max_ongoing_requests: int = Field(default=1024, ge=1)  # per Ingress/Scheduler replica: queue in the engine
    # Which replica a request goes to (deployments.routing.affinity): "affinity" = the one holding the
    # longest cached prefix of its prompt, unless its queue leads the least loaded one's by more than
    # routing_balance_abs requests and routing_balance_rel times; "serve" = Serve's power of two choices;
    # "auto" = affinity when data_parallel_size > 1.
    router: Literal["auto", "affinity", "serve"] = "auto"
    routing_balance_abs: int = Field(default=4, ge=0)
    routing_balance_rel: float = Field(default=1.5, ge=1.0)
    routing_min_match: float = Field(default=0.25, ge=0.0, le=1.0)  # share of the prompt's blocks held
    routing_stats_period_s: float = Field(default=1.0, gt=0.0)  # how often each replica reports its blocks

    # Fractional CPUs so the whole graph fits a 2-core machine; the YAML's `deployments:` may override.
    ingress_cpus: float = Field(default=0.1, gt=0.0)
    renderer_cpus: float = Field(default=0.1, gt=0.0)
    scheduler_cpus: float = Field(default=0.2, gt=0.0)
    rank_cpus: float = Field(default=0.5, gt=0.0)  # each tensor-parallel rank actor (tensor_parallel_size > 1)

    @field_validator("parallel")
    @classmethod
    def _parallel_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("parallel must be 'auto' or a positive integer")
        return value

    @field_validator("aliases")
    @classmethod
    def _aliases_nonempty(cls, value: list[str]) -> list[str]:
        if any(not alias.strip() for alias in value):
            raise ValueError("aliases must be nonempty strings")
        return value

    @model_validator(mode="after")
    def _learning_possible(self) -> "AppArgs":
        """Refuse at startup what cannot keep states on disk, naming the fix."""
        flag = "learn_conversations" if self.learn_conversations else "learn"
        if (self.learn or self.learn_conversations) and self.prompt_cache_gib == 0:
            raise ValueError(f"{flag} needs the engine to keep prompt states: prompt_cache_gib 0 keeps none")
        return self

    @model_validator(mode="after")
    def _model_exists(self) -> "AppArgs":
        resolve_model_dir(self.model)  # fail at startup, naming the path, not inside a replica
        if self.name is not None and not self.name.strip():
            raise ValueError("name must be a nonempty string")
        return self

    @property
    def affinity_routing(self) -> bool:
        return self.router == "affinity" or (self.router == "auto" and self.data_parallel_size > 1)

    @property
    def model_dir(self) -> Path:
        return resolve_model_dir(self.model)

    @property
    def served_name(self) -> str:
        return self.name or self.model_dir.name

    @property
    def model_ids(self) -> list[str]:
        """The served id, then each alias not already listed (the order /v1/models and /health use)."""
        ids = [self.served_name]
        ids.extend(alias for alias in self.aliases if alias not in ids)
        return ids

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=str(self.model_dir),
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            context=self.context,
            parallel=self.parallel,
            block_size=self.block_size,
            prefill_chunk_size=self.prefill_chunk_size,
            decode_share=self.decode_share,
            prompt_cache_gib=self.prompt_cache_gib,
            kv_cache_gib=self.kv_cache_gib,
            default_max_tokens=self.default_max_tokens,
            stream_interval_ms=self.stream_interval_ms,
            stream_events_per_second=self.stream_events_per_second,
            engine_process=self.engine_process,
            tensor_parallel_size=self.tensor_parallel_size,
            engine_threads=self.engine_threads,
            draft=self.draft,
            draft_tokens=self.draft_tokens,
            draft_policy=self.draft_policy,
            reserved_cpus=self.ingress_cpus + self.renderer_cpus,
            learn=self.learn,
            learn_conversations=self.learn_conversations,
            learn_dir=self.learn_dir,
            learn_gib=self.learn_gib,
            learn_min_free_gib=self.learn_min_free_gib,
            learn_daily_gib=self.learn_daily_gib,
        )
