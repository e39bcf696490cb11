"""`tensorfold bench ...`: benchmarks that print a table and compare side by side in one run."""

import argparse


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from serve_app.bench import engine_bench, serve_bench

    bench = subparsers.add_parser("bench", help="run a benchmark and print a table")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    engine_bench.add_parser(kinds)
    serve_bench.add_parser(kinds)
