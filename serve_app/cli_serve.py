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

from serve_app.args import AppArgs

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
    "tensor_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "placement_strategy": "placement_strategy",
    "prompt_cache_gib": "prompt_cache_gib",
    "decode_share": "decode_share",
    "default_max_tokens": "default_max_tokens",
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
    parser.add_argument("--tensor-parallel-size", type=int, help="ranks per model copy")
    parser.add_argument("--data-parallel-size", type=int, help="model copies (Scheduler replicas)")
    parser.add_argument("--placement-strategy", choices=["STRICT_PACK", "PACK"])
    parser.add_argument("--prompt-cache-gib", type=float, help="cap on cached prompt blocks; 0 = no reuse")
    parser.add_argument("--decode-share", type=float, help="decode time per prefill chunk (default 0.25)")
    parser.add_argument("--default-max-tokens", type=int, help="reply limit when a request sets none")
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
    return AppArgs(**values)


class _StopSignal:
    """SIGINT/SIGTERM: during startup, interrupt it; once serving, wake the main thread to shut down."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None
        self.serving = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if not self.serving:
            raise KeyboardInterrupt(self.received)  # unwinds startup; the caller's finally cleans up
        self.event.set()


def serve_blocking(args: AppArgs) -> int:
    import ray
    from ray import serve

    from serve_app.app import build_app

    stop = _StopSignal()
    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace="serve")
    stop.install()  # after ray.init, which installs its own SIGTERM handler (exit without Serve's shutdown)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        stop.serving = True
        print(f"tensorfold: serving {args.served_name} at http://{args.host}:{args.port}/v1", flush=True)
        stop.event.wait()
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve_blocking(args)
