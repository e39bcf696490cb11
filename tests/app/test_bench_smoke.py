"""Every `tensorfold bench` subcommand and every checkpoint size runs, through the CLI entry point, at its
smallest settings: a few tokens, a small image, one round. Each size `tensorfold fixture checkpoint` accepts
is built once for the module (the real shapes: `bench engine --size S` builds the same files,
serve_app/fixtures/sized.py) and loaded by the benchmarks that take it. What the figures say is not checked
here, only that each command gets through and prints its table. `bench serve` needs a server:
tests/e2e/test_bench_serve_e2e.py runs it against the session's."""

import argparse
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from serve_app.cli import build_parser, main  # noqa: E402
from serve_app.fixtures.archs import SIZE_ARCHS  # noqa: E402

FEW_TOKENS = ["--prompt-tokens", "8", "--decode-tokens", "2", "--concurrency", "2"]


def _choices(*path: str, option: str | None = None) -> list[str]:
    """A subcommand's subcommands (or, with `option`, that option's choices) as `tensorfold --help` lists them."""
    parser: argparse.ArgumentParser = build_parser()
    for name in path:
        (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subparsers.choices[name]
    if option is None:
        (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return list(subparsers.choices)
    (action,) = [a for a in parser._actions if option in a.option_strings]
    return list(action.choices)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every size `tensorfold fixture checkpoint` accepts, written once through the command ("tiny" as Qwen3)."""
    root = tmp_path_factory.mktemp("sizes")
    built = {}
    for size in _choices("fixture", "checkpoint", option="--size"):
        arch = SIZE_ARCHS[size] or "qwen3"
        assert main(["fixture", "checkpoint", str(root / size), "--arch", arch, "--size", size]) == 0
        built[size] = root / size
    return built


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the benchmarks set this process's intra-op threads


def _bench_runs(checkpoints: dict[str, Path]) -> dict[str, list[list[str]]]:
    """Each bench subcommand's runs: `engine` once per --size it accepts, on that size's checkpoint."""
    one_thread = ["--threads", "1"]
    sizes = _choices("bench", "engine", option="--size")
    return {
        "engine": [["--checkpoint", str(checkpoints[s]), *one_thread, *FEW_TOKENS] for s in sizes],
        "grammar": [["--checkpoint", str(checkpoints["bench"]), *FEW_TOKENS]],
        "store": [["--checkpoint", str(checkpoints["bench"]), *one_thread, "--prompt-tokens", "64"]],
        "snapshots": [
            ["--checkpoint", str(checkpoints["qwen3_5-200m"]), *one_thread, "--shared-tokens", "32"]
            + ["--question-tokens", "8", "--requests", "1", "--context", "128", "--every", "16"]
        ],
        "vision": [
            ["--checkpoint", str(checkpoints["qwen3_5-vl-bench"]), *one_thread, "--images", "1"]
            + ["--image-size", "64x48"]
        ],
        "dsa": [
            ["--checkpoint", str(checkpoints["glm5_next-200m"]), *one_thread, "--context", "40", "--decode-tokens", "2"]
        ],
        "drafts": [[*one_thread, "--max-tokens", "4", "--concurrency", "2", "--repeats", "1"]],
        "slide": [[*one_thread, "--facts", "1", "--prompt-tokens", "8", "--decode-tokens", "2", "--concurrency", "1"]],
        "sampler": [[*one_thread, "--rows", "2", "--vocab", "512", "--repeats", "1", "--top-logprobs", "2"]],
    }


# A line of each subcommand's table that only a finished run prints.
TABLE_LINES = {
    "engine": "decode tok/s, 2 concurrent",
    "grammar": "json_schema / unconstrained:",
    "store": "restored from disk",
    "snapshots": "interval  recomputed",
    "vision": "greedy first tokens",
    "drafts": "n-gram, batch 1",
    "dsa": "ms per decode step",
    "slide": "pocket / none:",
    "sampler": "| flat | T 0.8, top_p 0.95, top_k 40 | 2 |",
}


def test_every_bench_subcommand_has_a_smoke_run() -> None:
    assert sorted(_choices("bench")) == sorted([*TABLE_LINES, "serve"])  # serve: tests/e2e/test_bench_serve_e2e.py


@pytest.mark.parametrize("command", sorted(TABLE_LINES))
def test_each_bench_subcommand_runs_at_its_smallest_settings(
    command: str, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    for argv in _bench_runs(checkpoints)[command]:
        assert main(["bench", command, *argv]) == 0, argv
        out = capsys.readouterr().out
        assert TABLE_LINES[command] in out, out
