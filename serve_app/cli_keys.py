"""`tensorfold reload-keys [--app NAME]`: every Ingress replica of a running app re-reads its key file now.

What SIGHUP does for `tensorfold serve`, for graphs started any other way (`serve run`, `serve deploy`,
a RayService): it joins the cluster at RAY_ADDRESS (or the local one) and calls `reload_keys` on every
Ingress replica of the app through Serve's handle broadcast.
"""

import argparse
import os
import sys
from typing import Any

from serve_app.ray_network import keep_local_ray_on_loopback


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("reload-keys", help="make a running app re-read its API key file now")
    parser.add_argument("--app", default="tensorfold", help="the Serve application name (default tensorfold)")
    parser.set_defaults(func=run)


def run(namespace: argparse.Namespace) -> int:
    keep_local_ray_on_loopback()  # the server's Ray may be a single-machine one, on 127.0.0.1
    import ray

    from deployments.ingress.http.key_store import request_reload

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace="serve", log_to_driver=False)
    try:
        outcomes = request_reload(namespace.app)
    except Exception as exc:
        print(f"tensorfold reload-keys: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    for number, outcome in enumerate(outcomes, start=1):
        print(f"tensorfold: Ingress replica {number} of {namespace.app!r}: {outcome}")
    return 0 if outcomes and not any(o.startswith("closed") for o in outcomes) else 1
