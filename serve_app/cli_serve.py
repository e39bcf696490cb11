"""`tensorfold serve MODEL [flags]`: build AppArgs from the manual's flags and run the same graph as YAML.

Starts (or joins, with RAY_ADDRESS) a Ray cluster, runs the app on the given host and port, and blocks
until SIGINT or SIGTERM, then shuts Serve and Ray down so no replica or rank process is left behind.
"""

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from pydantic import ValidationError

from deployments.config import StartupError
from deployments.ingress.http.keys import ENV_VAR as API_KEY_ENV
from deployments.ingress.http.keys import auth_settings
from deployments.model_rank.backend import resolve_backend
from serve_app.args import AppArgs
from serve_app.launch import HTTP_ENTRIES, HttpEntry
from serve_app.listen_checks import exposure_warning, port_taken, raise_open_file_limit

APP_NAME = "tensorfold"
log = logging.getLogger("tensorfold.cli")

# flag -> AppArgs field, for the flags whose value passes through unchanged.
_FLAG_FIELDS = {
    "host": "host",
    "port": "port",
    "name": "name",
    "context": "context",
    "dtype": "dtype",
    "device": "device",
    "backend": "backend",
    "tensor_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "placement_strategy": "placement_strategy",
    "router": "router",
    "prompt_cache_gib": "prompt_cache_gib",
    "decode_share": "decode_share",
    "default_max_tokens": "default_max_tokens",
    "engine_threads": "engine_threads",
    "draft": "draft",
    "draft_tokens": "draft_tokens",
    "draft_policy": "draft_policy",
    "chat_template": "chat_template",
    "reasoning_effort": "reasoning_effort",
    "thinking_budget": "thinking_budget",
    "loop_guard": "loop_guard",
    "api_key_file": "api_key_file",
    "metrics_open": "metrics_open",
    "max_body_bytes": "max_body_bytes",
    "dashboard": "dashboard",
    "ready_wait": "ready_wait_s",
    "learn": "learn",
    "learn_conversations": "learn_conversations",
    "learn_dir": "learn_dir",
    "learn_gib": "learn_gib",
    "learn_min_free_gib": "learn_min_free_gib",
    "learn_daily_gib": "learn_daily_gib",
}


def _parallel(value: str) -> int | str:
    return value if value == "auto" else int(value)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible)")
    parser.add_argument("model", help="a checkpoint directory, or builtin:tiny-glm")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8080)")
    parser.add_argument("--name", help="the served model id (default: the checkpoint directory's name)")
    parser.add_argument("--alias", action="append", default=[], help="another id for the model (repeatable)")
    parser.add_argument("--context", type=int, help="cap on the context window, in tokens")
    parser.add_argument("--parallel", type=_parallel, help="concurrent sequences: N or auto")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--backend", choices=["auto", "torch", "mlx"],
                        help="forward pass: torch, or MLX (Metal on a Mac; default auto: MLX on Apple silicon)")
    parser.add_argument("--tensor-parallel-size", type=int, help="ranks per model copy")
    parser.add_argument("--data-parallel-size", type=int, help="model copies (Scheduler replicas)")
    parser.add_argument("--placement-strategy", choices=["STRICT_PACK", "PACK"])
    parser.add_argument("--router", choices=["auto", "affinity", "serve"],
                        help="replica choice: prefix affinity with balance, or Serve's (default: affinity when DP > 1)")
    parser.add_argument("--draft", choices=["auto", "mtp", "ngram", "off"],
                        help="drafter: the checkpoint's MTP layer, n-gram lookup, or none (default auto: MTP if present)")
    parser.add_argument("--draft-tokens", type=int, help="most drafts a round verifies (default: 3 for MTP, 4 n-gram)")
    parser.add_argument("--draft-policy", choices=["measured", "fixed"],
                        help="measured: lengths from acceptance and step cost (default); fixed: always --draft-tokens")
    parser.add_argument("--prompt-cache-gib", type=float, help="cap on cached prompt blocks; 0 = no reuse")
    parser.add_argument("--decode-share", type=float, help="decode time per prefill chunk (default 0.25)")
    parser.add_argument("--default-max-tokens", type=int, help="reply limit when a request sets none")
    parser.add_argument("--engine-threads", type=int,
                        help="intra-op threads of the forward pass (default: the node's cores less Ingress's and the Renderer's)")
    parser.add_argument("--chat-template", help="a UTF-8 Jinja chat template file replacing the checkpoint's")
    parser.add_argument("--reasoning-effort", choices=["none", "minimal", "low", "medium", "high", "xhigh", "max"],
                        help="effort of chat requests that set none (default: the template's own)")
    parser.add_argument("--thinking-budget", type=int, help="reasoning tokens before a forced close; 0 = none")
    parser.add_argument("--loop-guard", action="store_true", default=None,
                        help="close a think block caught in a short exact loop")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accept this key (repeatable; visible in the process list: prefer --api-key-file)")
    parser.add_argument("--api-key-file", metavar="PATH", help="a 0600 file of keys: one per line, 'label: key'")
    parser.add_argument("--metrics-open", action="store_true", default=None, help="serve /metrics without a key")
    parser.add_argument("--max-body-bytes", type=int, help="larger request bodies get HTTP 413 (default 16 MiB)")
    parser.add_argument("--dashboard", action="store_true", default=None,
                        help="serve a live /dashboard page and its /stats JSON snapshot")
    parser.add_argument("--learn", action="store_true", default=None,
                        help="keep shared prompt prefixes on disk too (what later requests found cached)")
    parser.add_argument("--learn-conversations", action="store_true", default=None,
                        help="keep every prompt state on disk too: conversations resume after a restart")
    parser.add_argument("--learn-dir", metavar="PATH", help="the store's folder (default ~/.cache/tensorfold/learned)")
    parser.add_argument("--learn-gib", type=float, help="disk the stored states may take, every model (default 32)")
    parser.add_argument("--learn-min-free-gib", type=float, help="free disk to keep (default 4)")
    parser.add_argument("--learn-daily-gib", type=float, help="bytes the store may write per day (default 32)")
    parser.add_argument("--ready-wait", type=float, metavar="SECONDS",
                        help="how long a request sent while the model loads waits for it, then 503 (default 60)")
    parser.add_argument("--http-entry", choices=HTTP_ENTRIES, default="ingress",
                        help="who answers HTTP on --port: the Ingress replica itself (default) or Serve's proxy")
    parser.set_defaults(func=run)


def app_args_from(namespace: argparse.Namespace) -> AppArgs:
    """Only the flags given override AppArgs' defaults, so the CLI and YAML share one set of defaults."""
    values: dict[str, Any] = {"model": namespace.model}
    for flag, field in _FLAG_FIELDS.items():
        value = getattr(namespace, flag, None)
        if value is not None:
            values[field] = value
    if namespace.parallel is not None:
        values["parallel"] = namespace.parallel
    if namespace.alias:
        values["aliases"] = list(namespace.alias)
    if getattr(namespace, "api_key", None):
        values["api_keys"] = list(namespace.api_key)
    return AppArgs(**values)


class _StopSignal:
    """SIGINT/SIGTERM: during startup, interrupt it; once serving, wake the main thread to shut down.
    SIGHUP: wake the main thread to ask every Ingress replica to re-read its key file."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None
        self.serving = False
        self.reloads = 0  # SIGHUPs not yet passed on

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, self._reload)

    def _reload(self, _signum: int, _frame: Any) -> None:
        self.reloads += 1
        self.event.set()

    def wait_for_stop(self, on_reload: Any) -> None:
        """Block until SIGINT/SIGTERM, calling `on_reload()` for each SIGHUP meanwhile."""
        while True:
            self.event.wait()
            self.event.clear()
            while self.reloads:
                self.reloads -= 1
                on_reload()
            if self.received is not None:
                return

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if not self.serving:
            raise KeyboardInterrupt(self.received)  # unwinds startup; the caller's finally cleans up
        self.event.set()


def serve_blocking(args: AppArgs, entry: HttpEntry = "ingress") -> int:
    import ray
    from ray import serve

    from serve_app.launch import init_ray, run_graph

    stop = _StopSignal()
    limits = raise_open_file_limit()  # before ray.init: the raylet, and so the replica serving HTTP, inherit it
    if limits is not None:
        log.info("open-file limit: soft %d (was %d)", limits[1], limits[0])
    init_ray(entry, args.port)
    stop.install()  # after ray.init, which installs its own SIGTERM handler (exit without Serve's shutdown)
    try:
        url = run_graph(args, entry, APP_NAME)
        stop.serving = True
        print(f"tensorfold: serving {args.served_name} at {url} ({entry} answers HTTP)", flush=True)
        stop.wait_for_stop(_reload_keys)
        print(f"tensorfold: {stop.received}, shutting down", flush=True)
        return 0
    except KeyboardInterrupt:
        print("tensorfold: interrupted during startup, shutting down", flush=True)
        return 130
    except Exception as exc:
        print(f"tensorfold: the server did not start: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        _shutdown(serve, ray)


def _reload_keys() -> None:
    from deployments.ingress.http.key_store import request_reload

    try:
        for outcome in request_reload(APP_NAME):
            print(f"tensorfold: SIGHUP, an Ingress replica {outcome}", flush=True)
    except Exception as exc:  # keep serving: the file's mtime check still picks up the change within a second
        print(f"tensorfold: SIGHUP, reload request failed: {exc}", file=sys.stderr, flush=True)


def _shutdown(serve: Any, ray: Any) -> None:
    """Serve first (replicas and rank actors stop), then the local Ray processes this command started."""
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run(namespace: argparse.Namespace) -> int:
    try:
        args = app_args_from(namespace)
    except ValidationError as exc:
        print(f"tensorfold serve: {exc}", file=sys.stderr)
        return 2
    try:  # a backend that cannot run here refuses before Ray starts
        resolve_backend(args.to_engine_config())
    except StartupError as exc:
        print(f"tensorfold serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:  # a bad key file (mode, content) refuses to start before Ray does
        auth = auth_settings(args.api_keys, args.api_key_file, args.metrics_open, os.environ.get(API_KEY_ENV))
    except ValueError as exc:
        print(f"tensorfold serve: {exc}", file=sys.stderr)
        return 2
    taken = port_taken(args.host, args.port)
    if taken is not None:
        print(f"tensorfold serve: {taken}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, auth.enabled)
    if warning:
        print(f"tensorfold: {warning}", file=sys.stderr, flush=True)
    args = args.model_copy(update={"http_entry": namespace.http_entry})  # the Ingress replica's env follows it
    return serve_blocking(args, namespace.http_entry)
