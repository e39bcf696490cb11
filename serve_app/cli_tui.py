"""`tensorfold tui --url URL --token-env VAR`: watch a running server in the terminal (docs/tui.md).

The key is read from the environment variable named by `--token-env`, never from the command line, where
the process list would show it.
"""

import argparse
import os
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("tui", help="a live terminal view of a running server, with a chat pane")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--token-env", metavar="VAR", help="the environment variable holding the API key")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")
    parser.set_defaults(func=run)


def run(namespace: argparse.Namespace) -> int:
    from serve_app.tui.app import MonitorApp
    from serve_app.tui.client import ServerAddress, ServerClient

    token = None
    if namespace.token_env:
        token = os.environ.get(namespace.token_env)
        if not token:
            print(f"tensorfold tui: ${namespace.token_env} is not set or empty", file=sys.stderr)
            return 2
    if namespace.interval <= 0:
        print("tensorfold tui: --interval must be positive", file=sys.stderr)
        return 2
    address = ServerAddress(namespace.url, token, namespace.token_env)
    MonitorApp(ServerClient(address), namespace.interval).run()
    return 0
