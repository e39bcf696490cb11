"""The app builder: `serve run configs/glm.yaml` and `tensorfold serve` both call `build_app`.

No `from __future__ import annotations` here: Serve reads the builder's parameter annotation at runtime
to validate the YAML's `args` into AppArgs; with postponed annotations it would pass a plain dict.

Layout: Ingress -> Renderer, Ingress -> Scheduler (one replica per model copy), Ingress ->
ResponseStore (one replica: stored Responses, shared by every Ingress replica), and with `--slide` Ingress ->
Slide (one replica: living weights' workflows) -> Renderer and Scheduler. At
tensor-parallel size N > 1 each Scheduler replica gets a placement group of N + 1 bundles: bundle 0 holds
the replica itself, bundle i + 1 rank i's actor (deployments/model_rank/deployment.py places the ranks
there and asks each rank's CPUs from TENSORFOLD_RANK_CPUS, which the replica's environment sets from
`rank_cpus`). Every deployment declares fractional CPUs so the graph fits a 2-core machine. The YAML's
`deployments:` section overrides these options; leave `ray_actor_options` to `args` (ingress_cpus,
renderer_cpus, scheduler_cpus, rank_cpus, device, and the custom resources that place replicas on nodes:
front_resources, scheduler_resources, rank_resources), since an override replaces the GPU and environment
settings made here (serve_env.py).
"""

import logging
import os
from typing import Any

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from deployments.chat_format.rendering import RendererOptions
from deployments.chat_format.template_file import load_template_file
from deployments.config import DEFAULT_MAX_BODY_BYTES, AuthSettings, SlideSettings
from deployments.ingress.deployment import Ingress
from deployments.ingress.http.keys import ENV_VAR as API_KEY_ENV
from deployments.ingress.http.keys import auth_settings
from deployments.model_rank.backend import resolve_backend
from deployments.model_rank.models import check_checkpoint
from deployments.prompt_store.links import STORE_FLUSH_S
from deployments.renderer.deployment import Renderer
from deployments.response_store.deployment import ResponseStoreDeployment
from deployments.routing.request_router import PrefixAffinityRouter
from deployments.scheduler.deployment import Scheduler
from deployments.scheduler.engine.disk_states import STOP_WRITES_S
from deployments.slide.deployment import Slide
from serve_app.args import AppArgs
from serve_app.ray_network import check_ray_network
from serve_app.serve_env import direct_ingress_env, replica_env

log = logging.getLogger("tensorfold.app")
STORE_CPUS = 0.05  # the ResponseStore only copies stored replies in and out
SLIDE_CPUS = 0.05  # the Slide room mostly waits on the Scheduler replicas (rendering is the Renderer's)
# Serve's per-call access line is off: Ingress logs every request itself (method, path, status, key label,
# time: deployments/ingress/http/auth.py) and its finish line, and the internal calls' lines were only noise,
# at a log record's cost on every request and stream.
QUIET = LoggingConfig(enable_access_log=False)
# A planned stop (docs/operations.md#a-planned-stop-sigterm): replies get `drain_grace_s` to finish, then the engine
# writes what waits for the disk store and the store flushes; Serve kills a replica past its budget.
STORE_STOP_S = STOP_WRITES_S + STORE_FLUSH_S
STOP_MARGIN_S = 2.0  # the calls and process exits around those steps
SHUTDOWN_POLL_S = 0.5  # how often Serve looks for a stopping replica's last requests (its default: 2 s)


def stop_options(args: AppArgs, after_drain_s: float = 0.0) -> dict[str, float]:
    """Serve's shutdown budget for a replica that stops after the drain's grace and `after_drain_s` more."""
    return {
        "graceful_shutdown_timeout_s": args.drain_grace_s + after_drain_s + STOP_MARGIN_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
    }


def resolve_device(args: AppArgs) -> str:
    """`auto` means CUDA when the Ray cluster has GPUs to place the ranks on, else CPU (MLX: never CUDA)."""
    if args.device != "auto":
        return args.device
    if args.backend == "mlx":
        return "cpu"
    try:
        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    except Exception:  # no cluster to ask (building outside Ray): the replicas will decide on CPU
        gpus = 0
    return "cuda" if gpus >= 1 else "cpu"


def placement_bundles(args: AppArgs, device: str) -> list[dict[str, float]]:
    """Bundle 0 for the Scheduler replica, then one bundle per tensor-parallel rank (a GPU each on CUDA)."""
    rank: dict[str, float] = {"CPU": args.rank_cpus, **args.rank_resources}
    if device == "cuda":
        rank["GPU"] = 1
    replica = {"CPU": args.scheduler_cpus, **args.scheduler_resources}
    return [replica] + [dict(rank) for _ in range(args.tensor_parallel_size)]


def actor_options(
    num_cpus: float, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, resources: dict[str, float] | None = None
) -> dict[str, Any]:
    """A replica's Ray actor options: its CPUs, its custom `resources` (the node labels that place it) and
    Serve's data-path settings (serve_env.py), sized for bodies up to `max_body_bytes`."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "runtime_env": {"env_vars": replica_env(max_body_bytes)}}
    if resources:
        options["resources"] = dict(resources)
    return options


def scheduler_options(args: AppArgs, device: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_replicas": args.data_parallel_size,
        "max_ongoing_requests": args.max_ongoing_requests,
        **stop_options(args, STORE_STOP_S),
    }
    if args.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = args.max_replicas_per_node
    actor = actor_options(args.scheduler_cpus, args.max_body_bytes, args.scheduler_resources)
    if args.tensor_parallel_size > 1:
        options["placement_group_bundles"] = placement_bundles(args, device)
        options["placement_group_strategy"] = args.placement_strategy
        actor["runtime_env"]["env_vars"]["TENSORFOLD_RANK_CPUS"] = str(args.rank_cpus)
    elif device == "cuda":
        actor["num_gpus"] = 1  # at size 1 the replica's engine (its child process or thread) holds the GPU
    options["ray_actor_options"] = actor
    if args.affinity_routing:
        options["request_router_config"] = affinity_router_config(args)
    return options


def affinity_router_config(args: AppArgs) -> RequestRouterConfig:
    """The Scheduler's request router: prefix affinity with balance (deployments/routing/request_router.py)."""
    kwargs = {
        "block_size": args.block_size,
        "balance_abs": args.routing_balance_abs,
        "balance_rel": args.routing_balance_rel,
        "min_match": args.routing_min_match,
        "stats_period_s": args.routing_stats_period_s,
    }
    return RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=args.routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 5 * args.routing_stats_period_s),
    )


def build_app(args: AppArgs) -> Application:
    return build_graph(args)


def build_graph(args: AppArgs, ingress_node_ip: str | None = None, auth: AuthSettings | None = None) -> Application:
    """The graph; `ingress_node_ip` places the Ingress replica on that node (it answers HTTP there itself).
    `auth`: the key digests a caller already read (tensorfold serve, which then drops TENSORFOLD_API_KEY from
    its environment before Ray starts); None reads them here, from the args and this process's environment."""
    check_ray_network(args.allow_unauthenticated_ray_network)  # before anything is deployed
    check_checkpoint(args.model_dir)  # one line naming the problem, before any deployment starts
    device = resolve_device(args)
    engine_config = args.engine_config().model_copy(update={"device": device})
    resolve_backend(engine_config)  # an MLX setting the rank refuses fails the deploy with its one-line fix
    if auth is None:
        auth = auth_settings(args.api_keys, args.api_key_file, args.metrics_open, os.environ.get(API_KEY_ENV))
        if os.environ.get(API_KEY_ENV):  # here a Ray worker's: every Ray process started beside it holds it
            log.warning("%s is in the Ray processes' environment; prefer api_key_file (docs/keys.md)", API_KEY_ENV)
    settings = args.ingress_settings(auth)  # digests only: replica args show in Ray's dashboard
    template = None if args.chat_template is None else load_template_file(args.chat_template)  # fails startup
    options = RendererOptions(chat_template=template, reasoning_effort=args.reasoning_effort)
    renderer = Renderer.options(
        ray_actor_options=actor_options(args.renderer_cpus, args.max_body_bytes, args.front_resources),
        logging_config=QUIET,
        **stop_options(args),
    )
    renderer = renderer.bind(str(args.model_dir), options, args.image_settings())
    scheduler = Scheduler.options(**scheduler_options(args, device), logging_config=QUIET).bind(engine_config)
    ingress_actor = actor_options(args.ingress_cpus, args.max_body_bytes, args.front_resources)
    if args.http_entry == "ingress":  # the replica runs the HTTP server on the port the controller hands it
        ingress_actor["runtime_env"]["env_vars"].update(direct_ingress_env(args.port))
    if ingress_node_ip is not None:
        ingress_actor.setdefault("resources", {})[f"node:{ingress_node_ip}"] = 0.001  # Ray's per-node resource
    ingress = Ingress.options(
        ray_actor_options=ingress_actor,
        max_ongoing_requests=args.max_ongoing_requests,
        logging_config=QUIET,
        **stop_options(args),
    )
    log.info(
        "graph: %s on %s, tp=%d dp=%d, router %s",
        args.served_name,
        device,
        args.tensor_parallel_size,
        args.data_parallel_size,
        "affinity" if args.affinity_routing else "serve",
    )
    responses = ResponseStoreDeployment.options(
        ray_actor_options=actor_options(STORE_CPUS, args.max_body_bytes, args.front_resources),
        logging_config=QUIET,
        **stop_options(args),
    )
    responses = responses.bind()
    slide = slide_room(args, renderer, scheduler, engine_config) if args.slide else None
    return ingress.bind(renderer, scheduler, settings, responses, slide)


def slide_room(args: AppArgs, renderer: Application, scheduler: Application, engine: SlideSettings) -> Application:
    """The Slide deployment (`--slide` only: without it the routes answer 501 and the graph starts one process
    fewer), over the same Renderer and Scheduler, with the engine's slide settings."""
    settings = SlideSettings.model_validate(engine.model_dump(include=set(SlideSettings.model_fields)))
    slide = Slide.options(
        ray_actor_options=actor_options(SLIDE_CPUS, args.max_body_bytes, args.front_resources),
        logging_config=QUIET,
        **stop_options(args),
    )
    return slide.bind(renderer, scheduler, settings)
