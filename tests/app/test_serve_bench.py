"""`tensorfold bench serve`'s measuring parts: rounds never share a cached prompt block, the in-process
baseline computes with the replica's threads, and the figures count every token of every round."""

import asyncio
import json

from serve_app.args import AppArgs
from serve_app.bench.serve_bench import RunFigures, StreamTimes, _record, _rounds, _run_http, _run_in_process


async def _figures_from(completions, rounds: list[list[list[int]]], max_tokens: int) -> RunFigures:
    """The load generator's figures against an aiohttp server answering /v1/completions with `completions`."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await _run_http(f"http://127.0.0.1:{runner.addresses[0][1]}/v1", "m", rounds, max_tokens)
    finally:
        await runner.cleanup()


def test_rounds_never_share_a_first_token() -> None:
    rounds = _rounds(5, 16, 64)
    prompts = [p for burst in rounds for p in burst]
    assert len(rounds) == 5 and all(len(burst) == 16 for burst in rounds)
    assert all(len(p) == 64 for p in prompts)
    assert len({p[0] for p in prompts}) == len(prompts)


def test_engine_threads_take_the_cores_the_other_replicas_leave() -> None:
    from deployments.model_rank.threads import engine_thread_count

    assert engine_thread_count(None, 0.2, cores=2) == 2  # Ingress + Renderer need 0.2 of a core
    assert engine_thread_count(None, 0.2, cores=1) == 1
    assert engine_thread_count(None, 0.2, ranks_on_node=2, cores=16) == 8
    assert engine_thread_count(None, 3.0, cores=2) == 1
    assert engine_thread_count(3, 0.2, cores=2) == 3  # an explicit count wins


def test_a_chunk_of_several_tokens_spreads_its_gap_over_them() -> None:
    times = StreamTimes()
    _record(times, start=0.0, last=0.0, count=1)  # the first token: TTFT only
    assert times.tokens == 1 and times.gaps == [] and times.ttft > 0
    _record(times, start=0.0, last=times.ttft, count=3)
    assert times.tokens == 4 and len(times.gaps) == 3 and len(set(times.gaps)) == 1


def test_in_process_figures_count_every_token_of_every_round(served_model: str) -> None:
    model_dir = str(AppArgs(model=served_model).model_dir)
    figures = asyncio.run(_run_in_process(model_dir, _rounds(2, 3, 12), max_tokens=5, lanes=3, threads=1))
    assert len(figures.streams) == 6
    assert all(s.tokens == 5 and len(s.gaps) == 4 for s in figures.streams)
    assert figures.wall > 0 and figures.row()["tok/s"] > 0


def test_the_load_generator_reads_long_events_and_counts_every_token() -> None:
    """A first event carrying a long prompt's ids is one SSE line of hundreds of KiB."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        first = {"choices": [{"token_ids": [5], "prompt_token_ids": list(range(100_000, 160_000))}]}
        await reply.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        await reply.write(b'data: {"choices":[{"token_ids":[6,7]}]}\n\ndata: [DONE]\n\n')
        return reply

    figures = asyncio.run(_figures_from(completions, [[[1, 2], [3, 4]]], 3))
    assert [s.tokens for s in figures.streams] == [3, 3]


def test_a_peer_without_token_ids_is_counted_by_its_events_then_settled_by_its_usage() -> None:
    """A peer server (llama.cpp's) sends text only: one token per event with text, and the final usage
    block's count replaces the tally (an event may hold no text while a character is still incomplete)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for text in ("a", "", "b"):
            await reply.write(b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": 3}}
        await reply.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return reply

    figures = asyncio.run(_figures_from(completions, [[[1, 2]]], 3))
    assert [(s.tokens, len(s.gaps)) for s in figures.streams] == [(3, 1)]  # TTFT, one gap; usage says 3


def test_the_snapshot_bench_resumes_later_prompts_within_each_interval(tmp_path, capsys) -> None:
    from serve_app.cli import main as cli_main
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    build_random_checkpoint("qwen3_5_text", tmp_path, seed=1)
    build_tokenizer(tmp_path, family="qwen")
    argv = ["bench", "snapshots", "--checkpoint", str(tmp_path), "--shared-tokens", "200", "--requests", "2"]
    assert (
        cli_main([*argv, "--question-tokens", "8", "--every", "32", "128", "--context", "512", "--threads", "1"]) == 0
    )
    rows = {
        int(line.split()[0]): line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.strip()[:1].isdigit()
    }
    assert float(rows[32][1]) <= 32 + 9 < float(rows[128][1]) <= 128 + 9  # recomputed: within an interval
    assert int(rows[32][3]) > int(rows[128][3])  # more snapshots held at the shorter interval
