"""Each deployment's settings, declared once: name, type, default, bounds, description and flag.

A user sets them as flat keys of the Serve config's `args` or as `tensorfold serve` flags; serve_app/args.py
composes the sections below into AppArgs and derives EngineConfig and IngressSettings from it, the CLI builds
its flags from the `Flag` markers (serve_app/cli_serve.py), and docs/config.md's table is generated from the
same fields (serve_app/settings_doc.py). Each section class names its `SECTION` in that table.
"""

from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class Flag:
    """How a setting reads on `tensorfold serve`'s command line. A setting without this marker gets the
    flag `--its-name` (underscores as dashes), helped by its description."""

    exists: bool = True  # False: only the YAML's `args` set it (NO_FLAG)
    name: str | None = None  # the flag where it is not `--its-name` (`--ready-wait` for ready_wait_s)
    metavar: str | None = None  # the value's placeholder in --help
    repeatable: bool = False  # a list, given one value per use of the flag (`--alias a --alias b`)
    positional: bool = False  # the command's positional argument (MODEL)
    help: str | None = None  # the flag's help where the description does not read well on a command line
    default: str | None = None  # the command's own default, where it is not the YAML's (`--http-entry`)


NO_FLAG = Flag(exists=False)


class Section(BaseModel):
    """A group of settings, one per table in docs/config.md; unknown keys are errors naming the key."""

    model_config = ConfigDict(extra="forbid")
    SECTION: ClassVar[str]


class EngineSettings(Section):
    """How a Scheduler replica's engine computes and paces its replies."""

    SECTION = "engine"

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="the weights' dtype; auto: the checkpoint's (a GGUF file's quantized weights kept as blocks with float32 activations on CPU, else bfloat16)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="where the ranks compute; auto: CUDA when the Ray cluster has GPUs"
    )
    backend: Literal["auto", "torch", "mlx"] = Field(
        default="auto",
        description="what computes the forward pass: torch, or MLX (Metal on a Mac); "
        "auto: MLX on an Apple-silicon Mac where mlx imports, torch elsewhere",
    )
    context: int | None = Field(
        default=None, ge=16, description="cap on the context window, in tokens; unset: the model's"
    )
    parallel: int | Literal["auto"] = Field(
        default="auto",
        description="lanes: sequences served at once per model copy: N, or auto (as many as full windows fit)",
    )
    block_size: Annotated[int, NO_FLAG] = Field(
        default=16, ge=1, description="tokens per KV-cache block (the prefix cache's and the router's unit)"
    )
    prefill_chunk_size: Annotated[int, NO_FLAG] = Field(
        default=512, ge=1, description="prompt tokens a prefill chunk takes at most"
    )
    decode_share: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="decode rounds' time per prefill chunk's time; "
        "0: each prompt prefills whole first, in arrival order",
    )
    prompt_cache_gib: float | None = Field(
        default=None,
        ge=0.0,
        description="cap on unreferenced cached prompt blocks, in GiB; unset: no cap beyond the pool; 0: no reuse "
        "across requests",
    )
    # Added to the flags (not one before): the pool's size is the memory knob a shared GPU needs at once.
    kv_cache_gib: float | None = Field(
        default=None, gt=0.0, description="the KV pool's size, in GiB; unset: sized from free memory"
    )
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="reply limit when a request sets none (always capped to the context left)"
    )
    # Tokens drawn while a reply's chunk waits ride in the next one, so a busy replica sends fewer, fuller
    # items over Ray; under load the events cap stretches each reply's interval to streams / the cap, which
    # bounds what the hops downstream spend per token.
    stream_interval_ms: Annotated[float, NO_FLAG] = Field(
        default=0.0,
        ge=0.0,
        le=1000.0,
        description="least time between two chunks of one reply leaving the "
        "Scheduler (the first and the last go at once)",
    )
    stream_events_per_second: Annotated[float, NO_FLAG] = Field(
        default=200.0, ge=0.0, description="chunks per second all of a replica's streams may send together; 0: no cap"
    )
    # A child process keeps the replica's own Python work (requests, streamed chunks) off the engine's GIL.
    engine_process: Annotated[bool, NO_FLAG] = Field(
        default=True,
        description="at tensor-parallel size 1, step the engine in a child process of the "
        "Scheduler replica rather than on a thread of it",
    )
    # Never Ray's OMP_NUM_THREADS (deployments/model_rank/threads.py).
    engine_threads: int | None = Field(
        default=None,
        ge=1,
        description="intra-op threads of the forward pass; unset: the node's cores less Ingress's and the Renderer's",
    )
    # cuBLAS picks its kernel by the row count, so a row's bits change with its batch; the Triton kernel keeps one
    # reduction order for every row count (kernels/matmul.py, docs/engine.md).
    cuda_matmul: Literal["invariant", "cublas"] = Field(
        default="invariant",
        description="the projections' and the lm_head's matmul on CUDA: invariant (a Triton kernel: a reply is the "
        "same whatever shares its step) or cublas (faster, but gives up batch invariance: a reply may change "
        "with the requests beside it)",
    )
    # On CUDA, decode steps replay graphs captured at startup (docs/engine.md, The step on a GPU); this turns
    # them off (vLLM's name). On CPU every step is eager anyway: there is nothing to capture.
    enforce_eager: bool = Field(
        default=False,
        description="on a CUDA device, launch every step's kernels eagerly: no decode CUDA graphs are "
        "captured at startup (one per batch-size bucket up to the lanes)",
    )
    # Hybrid models: besides the end of every prompt pass and reply, a long prompt's recurrent states join
    # the prefix cache at least this often (each snapshot costs a state slot: docs/engine.md, Hybrid models).
    state_snapshot_tokens: Annotated[int, NO_FLAG] = Field(
        default=1024,
        ge=16,
        description="hybrid models: a long prompt's recurrent states are kept for the prefix cache at least "
        "every this many tokens (besides each prompt's and reply's end)",
    )

    @field_validator("parallel")
    @classmethod
    def _parallel_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("parallel must be 'auto' or a positive integer")
        return value


class DraftSettings(Section):
    """Drafts: several tokens per round, every reply the same as serial decoding's, token for token
    (deployments/scheduler/engine/drafts.py)."""

    SECTION = "drafts"

    draft: Literal["auto", "mtp", "ngram", "off"] = Field(
        default="auto",
        description="the drafter: the checkpoint's MTP layer, n-gram prompt lookup, or none; "
        "auto: MTP where the checkpoint has it, else n-gram",
    )
    draft_tokens: int | None = Field(
        default=None, ge=1, le=16, description="most drafts a round verifies; unset: the drafter's (3 MTP, 4 n-gram)"
    )
    draft_policy: Literal["measured", "fixed"] = Field(
        default="measured",
        description="measured: each round's lengths from acceptance and step cost (none when "
        "drafting does not pay); fixed: always draft_tokens",
    )

    @property
    def wants_mtp(self) -> bool:
        """Whether the ranks should load the MTP layer's drafting (it runs only where the checkpoint has one)."""
        return self.draft in ("auto", "mtp")


class StoreSettings(Section):
    """The disk prompt-state store (deployments/prompt_store): every state kept in RAM also goes to disk, and a
    prompt continuing past RAM's states resumes from disk (after a restart too) when reading beats prefilling."""

    SECTION = "store"

    learn: bool = Field(
        default=False,
        description="keep shared prompt prefixes on disk too (blocks a later "
        "request found cached), in a store of their own",
    )
    learn_conversations: bool = Field(
        default=False,
        description="keep every prompt state on disk too, so conversations resume after a restart "
        "(implies learn, in place of its store)",
    )
    learn_dir: Annotated[str, Flag(metavar="PATH")] = Field(
        default="~/.cache/tensorfold/learned", description="the store's folder"
    )
    learn_shared: bool = Field(
        default=False,
        description="learn_dir is one folder several nodes share (network storage): a prompt past what this node's "
        "store has indexed looks there for the states other nodes wrote (a file check or two per such prompt)",
    )
    learn_gib: float = Field(default=32.0, gt=0.0, description="disk the stored states may take, every model's")
    learn_min_free_gib: float = Field(
        default=4.0, ge=0.0, description="free disk to keep; below it, states stay in RAM only"
    )
    learn_daily_gib: float = Field(
        default=32.0, gt=0.0, description="bytes the store may write per day; past it, states stay in RAM only"
    )

    @property
    def learning(self) -> bool:
        return self.learn or self.learn_conversations


class TensorParallel(Section):
    """The graph's one setting the engine reads too: how many ranks it drives."""

    SECTION = "graph"

    tensor_parallel_size: int = Field(default=1, ge=1, description="ranks per model copy (gloo on CPU, NCCL on GPUs)")


class VisionModel(Section):
    """Whether the checkpoint's vision tower is loaded: the engine builds it (on every rank: docs/engine.md,
    Vision; off, its weights are never read), the Renderer reads images for it."""

    SECTION = "vision"

    vision: bool = Field(
        default=False,
        description="load the checkpoint's vision tower and read image parts (qwen3_5 and qwen3_5_moe); "
        "off: image parts get HTTP 400",
    )


class ImageSettings(VisionModel):
    """Where images may come from and how large they may be (docs/vision.md); the Renderer reads them."""

    SECTION = "vision"

    vision_urls: bool = Field(
        default=False, description="also fetch public https:// image URLs; off: only data: URLs are read"
    )
    max_images: int = Field(default=8, ge=1, description="images one request may carry")
    max_image_bytes: int = Field(
        default=10 << 20, ge=1024, description="bytes of one image (decoded from base64, or fetched)"
    )
    max_image_pixels: int = Field(
        default=40_000_000, ge=64, description="pixels of one image (width x height), checked before decoding"
    )
    image_connect_timeout_s: Annotated[float, Flag(name="--image-connect-timeout", metavar="SECONDS")] = Field(
        default=5.0, gt=0.0, description="seconds to connect to an image URL's server"
    )
    image_read_timeout_s: Annotated[float, Flag(name="--image-read-timeout", metavar="SECONDS")] = Field(
        default=10.0, gt=0.0, description="seconds an image URL's reply may take to arrive whole (and each read)"
    )

    @model_validator(mode="after")
    def _urls_need_vision(self) -> "ImageSettings":
        if self.vision_urls and not self.vision:
            raise ValueError("vision_urls needs vision: image URLs are read only when images are")
        return self


class SlideSettings(Section):
    """Living weights (docs/slide.md): facts learned into a pocket of neurons beside the last layer's MLP,
    checked by asking their questions, and deleted exactly."""

    SECTION = "slide"

    slide: bool = Field(
        default=False,
        description="learn facts into the served weights over /v1/slide (attention-only torch models); "
        "off: those routes answer 501",
    )
    slide_dir: Annotated[str, Flag(metavar="PATH")] = Field(
        default="~/.cache/tensorfold/slide", description="the folder of the pocket's shards and the fact graph"
    )
    # Measured with `tensorfold bench slide` (docs/benchmarks.md): a neuron per answer row of a short answer.
    slide_neurons: int = Field(default=8, ge=1, le=64, description="pocket neurons each fact owns")
    slide_capacity: int = Field(default=256, ge=1, le=65536, description="facts the pocket holds at most")
    slide_steps: int = Field(default=1000, ge=1, le=100000, description="optimisation steps one fact may take")
    slide_margin: Annotated[float, NO_FLAG] = Field(
        default=1.0, gt=0.0, description="how far a pocket neuron's pre-activation stays from zero, on and off its fact"
    )
    slide_learning_rate: Annotated[float, NO_FLAG] = Field(
        default=0.05, gt=0.0, le=10.0, description="the pocket optimiser's step size (Adam)"
    )

    @property
    def pocket_neurons(self) -> int:
        """Neurons in the pocket (0 without slide)."""
        return self.slide_capacity * self.slide_neurons if self.slide else 0


class EngineKnobs(EngineSettings, DraftSettings, StoreSettings, TensorParallel, VisionModel, SlideSettings):
    """Every engine setting a user sets: the part of AppArgs that EngineConfig carries whole."""

    @model_validator(mode="after")
    def _learning_possible(self) -> "EngineKnobs":
        """Refuse at startup what cannot keep states on disk, naming the fix."""
        flag = "learn_conversations" if self.learn_conversations else "learn"
        if self.learning and self.prompt_cache_gib == 0:
            raise ValueError(f"{flag} needs the engine to keep prompt states: prompt_cache_gib 0 keeps none")
        return self


class EngineConfig(EngineKnobs):
    """What a Scheduler replica needs to open its engine: `AppArgs.engine_config()`, or built directly in tests
    (with the production defaults)."""

    model: str  # checkpoint directory
    max_parallel_auto: int = Field(default=64, ge=1)  # ceiling of `parallel: auto`
    reserved_cpus: float = Field(default=0.0, ge=0.0)  # CPUs the graph's other replicas on the node need


class KeyEntry(BaseModel):
    """One accepted key, as the server keeps it: a non-secret label and the key's SHA-256 hex digest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    digest: str


class AuthSettings(BaseModel):
    """What an Ingress replica needs to authenticate: digests of the fixed keys, and the key file's path
    (deployments/ingress/http/keys.py builds it at startup)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed: list[KeyEntry] = []  # from --api-key and TENSORFOLD_API_KEY
    key_file: str | None = None  # read by each replica, re-read when it changes
    metrics_open: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.fixed) or self.key_file is not None


class IngressHttp(Section):
    """What an Ingress replica's HTTP surface allows: body size, the dashboard, the wait for a loading model."""

    SECTION = "HTTP"

    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get HTTP 413"
    )
    dashboard: bool = Field(default=False, description="serve a live /dashboard page and its /stats JSON snapshot")
    ready_wait_s: Annotated[float, Flag(name="--ready-wait", metavar="SECONDS")] = Field(
        default=60.0, ge=0.0, description="seconds a request sent while the model loads waits for it, then 503"
    )
    # 8 s, then the disk store's last writes (up to 20 s), fit a 30 s stop budget (Kubernetes' default).
    drain_grace_s: Annotated[float, Flag(name="--drain-timeout", metavar="SECONDS")] = Field(
        default=8.0,
        ge=0.0,
        le=600.0,
        description="on a planned stop (SIGTERM), seconds the replies in flight may take to finish; "
        "the rest end with an error",
    )


class ThinkingDefaults(Section):
    """Thinking limits the Ingress gives the requests that set none (deployments/scheduler/engine/thinking.py)."""

    SECTION = "chat"

    thinking_budget: int = Field(
        default=0, ge=0, description="reasoning tokens before a forced close, for requests that set none; 0: none"
    )
    loop_guard: bool = Field(default=False, description="close a think block caught in a short exact loop")


class ToolPolicy(Section):
    """What the Ingress does with tools it does not run (docs/agents/codex.md)."""

    SECTION = "chat"

    # Codex offers OpenAI's hosted tools (web_search) by default; refusing them is the documented default.
    drop_builtin_tools: bool = Field(
        default=False,
        description="leave built-in tools (web_search, file_search, ...) out of Responses requests, logging their "
        "types, instead of refusing the request",
    )


def package_version() -> str:
    try:
        return metadata.version("tensorfold")
    except metadata.PackageNotFoundError:  # running from a checkout without an install
        return "0.0.0+source"


class IngressSettings(IngressHttp, ThinkingDefaults, ToolPolicy, SlideSettings):
    """What an Ingress replica is built with: `AppArgs.ingress_settings(auth)`, or built directly in tests."""

    served_name: str
    model_ids: list[str]  # the served name, then each alias
    version: str = package_version()
    auth: AuthSettings = AuthSettings()  # key digests and the key file; no keys: every route open
    learn_conversations: bool = False  # the disk prompt-state store is on: the imprint routes answer


class StartupError(ValueError):
    """The engine cannot open (too little memory, bad settings); the message says what to change."""
