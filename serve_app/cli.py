"""`tensorfold`: the command line. Each subcommand lives in its own module and registers itself here."""

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module, function): the function adds one subcommand to the subparsers it is given, and the subcommand's
# parser sets `func(namespace) -> int`. Modules are imported when the parser is built; keep their imports
# light (torch, Ray and transformers belong inside `func`).
COMMANDS = (
    ("serve_app.cli_serve", "register"),  # tensorfold serve MODEL [flags]
    ("serve_app.cli_keys", "register"),  # tensorfold reload-keys [--app NAME]
    ("serve_app.cli_service", "register"),  # tensorfold service install|uninstall|status
    ("serve_app.cli_tui", "register"),  # tensorfold tui --url URL --token-env VAR
    ("serve_app.settings_doc", "register"),  # tensorfold settings [--write]
    ("serve_app.fixtures.cli", "add_fixture_parser"),  # tensorfold fixture ...
    ("serve_app.bench", "add_bench_parser"),  # tensorfold bench ...
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorfold", description="TensorFold: an LLM server on Ray Serve.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name, function_name in COMMANDS:
        getattr(importlib.import_module(module_name), function_name)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    return int(namespace.func(namespace) or 0)


if __name__ == "__main__":
    sys.exit(main())
