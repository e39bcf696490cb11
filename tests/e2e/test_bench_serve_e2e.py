"""`tensorfold bench serve` at its smallest settings, through the CLI entry point, against the session's tiny-glm
app (`--url`, which it addresses by the name the app lists) beside the engine in-process: the one bench
subcommand tests/app/test_bench_smoke.py leaves to this folder, since it needs a server. Starting a graph
of its own is `tensorfold serve`'s launch (tests/e2e/test_cli_serve_e2e.py); `--multi-turn` starts two graphs
of two copies each and is not run."""

import pytest

from serve_app.cli import main

pytestmark = pytest.mark.e2e


def test_bench_serve_measures_a_running_server_beside_the_engine_in_process(
    glm_base_url: str, capsys: pytest.CaptureFixture
) -> None:
    argv = ["bench", "serve", "--url", f"{glm_base_url}/v1", "--rounds", "1", "--concurrency", "2"]
    assert main([*argv, "--max-tokens", "2", "--prompt-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "graph over HTTP" in out and "engine in-process" in out, out
