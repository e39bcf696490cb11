"""The one schema of the app's arguments: the Serve config's `args`, and what `tensorfold serve` builds.

`serve run configs/*.yaml` hands the YAML's `args` mapping to `build_app`, whose single parameter is
annotated with `AppArgs`, so Serve validates it here; `tensorfold serve MODEL --flags` builds the same
model from the command line. The keys stay flat: AppArgs inherits every section, the app's own below and
the deployments' from deployments/config.py, and derives what each deployment is built with from itself.
Unknown keys are errors that name the key (extra="forbid"). docs/config.md lists every key.
"""

from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator

from deployments.config import (
    NO_FLAG,
    AuthSettings,
    EngineConfig,
    EngineKnobs,
    Flag,
    ImageSettings,
    IngressHttp,
    IngressSettings,
    Section,
    ThinkingDefaults,
    ToolPolicy,
)
from deployments.gguf_files.folder import checkpoint_folder, is_gguf

BUILTIN_PREFIX = "builtin:"
BUILTIN_ROOT = Path(__file__).resolve().parent / "builtin"
DEFAULT_MODEL = "builtin:tiny-glm"
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
Derived = TypeVar("Derived", bound=BaseModel)


def resolve_model_dir(model: str, derive: bool = True) -> Path:
    """`builtin:NAME` names a checkpoint shipped inside the package; a `.gguf` file (or the first of a split
    set) is opened as its derived checkpoint folder (docs/gguf.md; `derive` False: the file itself, only
    checked to exist); anything else is a directory path."""
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX) :]
        available = sorted(p.name for p in BUILTIN_ROOT.iterdir() if p.is_dir()) if BUILTIN_ROOT.is_dir() else []
        if not name or name not in available:
            raise ValueError(f"unknown builtin model {model!r} (available: {', '.join(available) or 'none'})")
        return BUILTIN_ROOT / name
    path = Path(model).expanduser().resolve()
    if is_gguf(path):
        return checkpoint_folder(path) if derive else path
    if not path.is_dir():
        raise ValueError(f"model {model!r}: no checkpoint directory or .gguf file at {path}")
    return path


class ModelSettings(Section):
    """What is served and under which names."""

    SECTION = "model"

    model: Annotated[str, Flag(positional=True, metavar="MODEL")] = Field(
        default=DEFAULT_MODEL, description="a checkpoint directory, a .gguf file, or builtin:tiny-glm"
    )
    name: str | None = Field(default=None, description="the served model id; unset: the checkpoint directory's name")
    aliases: Annotated[list[str], Flag(name="--alias", repeatable=True)] = Field(
        default_factory=list, description="another id for the model, listed by /v1/models and accepted in requests"
    )

    @field_validator("aliases")
    @classmethod
    def _aliases_nonempty(cls, value: list[str]) -> list[str]:
        if any(not alias.strip() for alias in value):
            raise ValueError("aliases must be nonempty strings")
        return value

    @model_validator(mode="after")
    def _model_exists(self) -> "ModelSettings":
        resolve_model_dir(self.model, derive=False)  # fail at startup, naming the path, not inside a replica
        if self.name is not None and not self.name.strip():
            raise ValueError("name must be a nonempty string")
        return self

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


class HttpSettings(Section):
    """The HTTP binding. `tensorfold serve` uses host and port; under `serve run` the YAML's http_options decide."""

    SECTION = "HTTP"

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8080, ge=1, le=65535, description="port")
    # Direct ingress needs Serve's controller started with its settings too: configs/glm.yaml's
    # controller_options, or `tensorfold serve`, whose own default it is (serve_app/launch.py).
    http_entry: Annotated[Literal["ingress", "proxy"], Flag(default="ingress")] = Field(
        default="proxy",
        description="who answers HTTP on the port: the Ingress replica itself (Serve's direct ingress), "
        "or Serve's proxy",
    )


class KeySettings(Section):
    """API keys (deployments/ingress/http/keys.py): added to TENSORFOLD_API_KEY's; prefer a 0600 key file."""

    SECTION = "keys"

    api_keys: Annotated[
        list[str],
        Flag(
            name="--api-key",
            metavar="KEY",
            repeatable=True,
            help="accept this key (visible in the process list: prefer --api-key-file)",
        ),
    ] = Field(
        default_factory=list,
        repr=False,
        description="keys to accept, besides TENSORFOLD_API_KEY's (never printed with the args)",
    )
    api_key_file: Annotated[str | None, Flag(metavar="PATH")] = Field(
        default=None, description="a 0600 file of keys: one per line, 'label: key'"
    )
    metrics_open: bool = Field(default=False, description="serve /metrics and /v1/metrics without a key")


class ChatSettings(Section):
    """Chat rendering (deployments/chat_format); the thinking defaults are the Ingress's, in ThinkingDefaults."""

    SECTION = "chat"

    chat_template: str | None = Field(
        default=None, description="a UTF-8 Jinja chat template file replacing the checkpoint's"
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        default=None, description="effort of chat requests that set none; unset: the template's own"
    )


class GraphSettings(Section):
    """Model copies, ranks per copy (TensorParallel) and how the ranks are placed."""

    SECTION = "graph"

    data_parallel_size: int = Field(default=1, ge=1, description="model copies (Scheduler replicas)")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="STRICT_PACK",
        description="how one model copy's placement group (its Scheduler replica, then each rank) meets the nodes: "
        "STRICT_PACK one node; PACK as few as fit; SPREAD as many as fit; STRICT_SPREAD each on its own node",
    )
    rank_resources: Annotated[dict[str, float], NO_FLAG] = Field(
        default_factory=dict,
        description="custom Ray resources each tensor-parallel rank's bundle asks for (a node label such as "
        "`{gpu_node: 0.01}`, given to the nodes by `ray start --resources`)",
    )
    scheduler_resources: Annotated[dict[str, float], NO_FLAG] = Field(
        default_factory=dict,
        description="custom Ray resources each Scheduler replica (model copy) asks for, such as "
        "`{model_node: 0.01}`: the copies land only on nodes started with that resource",
    )
    front_resources: Annotated[dict[str, float], NO_FLAG] = Field(
        default_factory=dict,
        description="custom Ray resources the Ingress, Renderer and ResponseStore replicas ask for, such as "
        "`{node_head: 0.01}`: the HTTP front and rendering stay on that node, so losing a model copy's node "
        "never takes them with it",
    )
    max_replicas_per_node: int | None = Field(
        default=None,
        ge=1,
        description="at most this many Scheduler replicas (model copies) on one node; unset: no limit",
    )
    max_ongoing_requests: Annotated[int, NO_FLAG] = Field(
        default=1024,
        ge=1,
        description="requests each Ingress and Scheduler replica takes at once (they queue in the engine)",
    )

    @field_validator("rank_resources", "scheduler_resources", "front_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        """Ray takes CPUs, GPUs and memory from their own options (the *_cpus settings, `device`), and
        refuses a resource asked for in an amount that is not positive."""
        for name, amount in value.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is not a custom resource: CPUs come from the *_cpus settings")
            if amount <= 0:
                raise ValueError(f"resource {name!r}: the amount must be positive, not {amount}")
        return value


class ClusterSettings(Section):
    """Ray's own ports (serve_app/ray_network.py): startup refuses an unauthenticated Ray beyond loopback."""

    SECTION = "cluster"

    allow_unauthenticated_ray_network: bool = Field(
        default=False,
        description="start although Ray's token authentication is off and Ray listens beyond loopback: "
        "anyone who reaches Ray's ports can then run code as this server's user (cluster/README.md)",
    )


class RoutingSettings(Section):
    """Which Scheduler replica a request goes to (deployments/routing/affinity.py)."""

    SECTION = "routing"

    router: Literal["auto", "affinity", "serve"] = Field(
        default="auto",
        description="which replica a request goes to: affinity (the one holding the longest cached prefix of its "
        "prompt, unless its queue leads the least loaded one's by more than routing_balance_abs requests and "
        "routing_balance_rel times), serve (Serve's power of two choices), or auto (affinity when "
        "data_parallel_size > 1)",
    )
    routing_balance_abs: Annotated[int, NO_FLAG] = Field(
        default=4, ge=0, description="requests the affinity target's queue may lead the least loaded one's by"
    )
    routing_balance_rel: Annotated[float, NO_FLAG] = Field(
        default=1.5, ge=1.0, description="times the affinity target's queue may be the least loaded one's"
    )
    routing_min_match: Annotated[float, NO_FLAG] = Field(
        default=0.25, ge=0.0, le=1.0, description="share of the prompt's blocks a replica must hold to count as a match"
    )
    routing_stats_period_s: Annotated[float, NO_FLAG] = Field(
        default=1.0, gt=0.0, description="seconds between two reports of each replica's cached blocks"
    )


class ResourceSettings(Section):
    """Fractional CPUs so the whole graph fits a 2-core machine; the YAML's `deployments:` may override."""

    SECTION = "resources"

    ingress_cpus: Annotated[float, NO_FLAG] = Field(default=0.1, gt=0.0, description="Ray CPUs per Ingress replica")
    renderer_cpus: Annotated[float, NO_FLAG] = Field(default=0.1, gt=0.0, description="Ray CPUs per Renderer replica")
    scheduler_cpus: Annotated[float, NO_FLAG] = Field(default=0.2, gt=0.0, description="Ray CPUs per Scheduler replica")
    rank_cpus: Annotated[float, NO_FLAG] = Field(
        default=0.5, gt=0.0, description="Ray CPUs per tensor-parallel rank actor (tensor_parallel_size > 1)"
    )


class AppArgs(
    ModelSettings,
    HttpSettings,
    IngressHttp,
    KeySettings,
    EngineKnobs,
    ChatSettings,
    ThinkingDefaults,
    ImageSettings,
    ToolPolicy,
    GraphSettings,
    ClusterSettings,
    RoutingSettings,
    ResourceSettings,
):
    """Everything that shapes one served model: the engine, the HTTP surface and the graph's layout."""

    @property
    def affinity_routing(self) -> bool:
        return self.router == "affinity" or (self.router == "auto" and self.data_parallel_size > 1)

    def engine_config(self) -> EngineConfig:
        """The Scheduler's config: every engine setting as given, the checkpoint's directory, and the CPUs the
        node's Ingress and Renderer replicas keep from the engine's threads."""
        reserved = self.ingress_cpus + self.renderer_cpus
        return self._derive(EngineConfig, model=str(self.model_dir), reserved_cpus=reserved)

    def ingress_settings(self, auth: AuthSettings) -> IngressSettings:
        """The Ingress replicas' settings; `auth` holds the keys' digests only (deployments/ingress/http/keys.py)."""
        return self._derive(IngressSettings, served_name=self.served_name, model_ids=self.model_ids, auth=auth)

    def image_settings(self) -> ImageSettings:
        """The Renderer's image settings: whether it reads images, from where, and their limits."""
        return self._derive(ImageSettings)

    def _derive(self, target: type[Derived], **derived: object) -> Derived:
        """`target` from every field it shares with these args by name, then `derived` (which wins: `model`
        names the checkpoint's directory there, not the argument as given)."""
        shared = {name: getattr(self, name) for name in target.model_fields if name in type(self).model_fields}
        return target(**{**shared, **derived})
