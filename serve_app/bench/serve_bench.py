"""`tensorfold bench serve`: N concurrent streams through the HTTP graph and through the engine in-process.

Both runs send the same rounds (bursts of N streams, new prompts each round, so no round reads another's
prompt cache) with the same limits, and the in-process engine computes with the intra-op threads Ray gives
the Scheduler replica. The table shows TTFT and inter-token latency percentiles over every stream of every
round and throughput over the rounds' wall time, so the cost the graph adds (Ray hops, HTTP, SSE
framing, the processes it runs beside the engine) reads off directly. Streams are greedy unless
`--temperature` (with `--top-p`, `--top-k`) samples them, on both sides.
"""

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from serve_app.args import AppArgs
from serve_app.launch import HTTP_ENTRIES, HttpEntry, init_ray, run_graph


@dataclass
class StreamTimes:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # per token, between consecutive arrivals
    tokens: int = 0


@dataclass
class RunFigures:
    label: str
    streams: list[StreamTimes]  # every round's
    wall: float  # the rounds' wall time, summed

    def pct(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else 0.0

    def row(self) -> dict[str, float]:
        ttfts = [s.ttft for s in self.streams]
        gaps = [g for s in self.streams for g in s.gaps]
        tokens = sum(s.tokens for s in self.streams)
        return {
            "ttft p50 ms": self.pct(ttfts, 0.5),
            "ttft p90 ms": self.pct(ttfts, 0.9),
            "itl p50 ms": self.pct(gaps, 0.5),
            "itl p90 ms": self.pct(gaps, 0.9),
            "itl p99 ms": self.pct(gaps, 0.99),
            "tok/s": tokens / self.wall,
        }


def _rounds(rounds: int, count: int, length: int) -> list[list[list[int]]]:
    """`rounds` bursts of `count` prompts; up to 200 in all, no two share a first token (or a cached block)."""
    return [
        [[(17 * (r * count + i) + 31 * j) % 200 + 10 for j in range(length)] for i in range(count)]
        for r in range(rounds)
    ]


@dataclass(frozen=True)
class Sampling:
    """How every stream draws its tokens, over HTTP and in-process alike (greedy unless told)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def body(self) -> dict[str, float]:
        sampled = {"top_p": self.top_p, "top_k": self.top_k} if self.temperature > 0 else {}
        return {"temperature": self.temperature, **sampled}


async def _http_stream(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int, sampling: Sampling
) -> StreamTimes:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        **sampling.body(),
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    times = StreamTimes()
    start = last = time.perf_counter()
    async with session.post(f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            count = _event_tokens(event.get("choices") or [])
            if count:
                _record(times, start, last, count)
                last = time.perf_counter()
            if event.get("usage"):  # the server's own count settles a peer's text-only events
                times.tokens = event["usage"]["completion_tokens"]
    return times


def _event_tokens(choices: list[dict]) -> int:
    """Tokens in one event: its token ids, or one per event with text where a peer server sends no ids."""
    if any("token_ids" in c for c in choices):
        return sum(len(c.get("token_ids") or []) for c in choices)
    return sum(1 for c in choices if c.get("text"))


def _record(times: StreamTimes, start: float, last: float, count: int) -> None:
    now = time.perf_counter()
    if times.tokens == 0:
        times.ttft = now - start
        count -= 1
        times.tokens = 1
    if count > 0:
        times.gaps.extend([(now - last) / count] * count)
        times.tokens += count


StreamRunner = Callable[[list[int], int], Awaitable[StreamTimes]]  # (prompt, max_tokens) -> its figures


async def _timed_rounds(label: str, stream: StreamRunner, rounds: list[list[list[int]]], max_tokens: int) -> RunFigures:
    """Each round's streams start together; the next round starts when the last of them has finished."""
    await stream(rounds[0][0][:8], 2)  # warm-up
    figures = RunFigures(label, [], 0.0)
    for prompts in rounds:
        start = time.perf_counter()
        figures.streams += await asyncio.gather(*[stream(p, max_tokens) for p in prompts])
        figures.wall += time.perf_counter() - start
    return figures


async def _run_http(
    url: str,
    model: str,
    rounds: list[list[list[int]]],
    max_tokens: int,
    label: str = "graph over HTTP",
    sampling: Sampling = Sampling(),
) -> RunFigures:
    # aiohttp: the load generator shares this machine's cores with the server, so it should cost little.
    # Every stream on a connection of its own (force_close: some peers close a kept-alive one after a stream).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def stream(prompt: list[int], limit: int) -> StreamTimes:
            return await _http_stream(session, url, model, prompt, limit, sampling)

        return await _timed_rounds(label, stream, rounds, max_tokens)


async def _served_model(url: str) -> str:
    """The model a running server answers to, the first its /v1/models lists (--model names the in-process side,
    and a server may serve it under another name)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]


async def _run_in_process(
    model_dir: str,
    rounds: list[list[list[int]]],
    max_tokens: int,
    lanes: int,
    threads: int,
    dtype: str = "auto",
    draft: str = "auto",
    sampling: Sampling = Sampling(),
) -> RunFigures:
    import torch

    from deployments.config import EngineConfig
    from deployments.messages.requests import EngineRequest, SamplingParams
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    # Unpaced (stream_events_per_second 0): the baseline is the bare engine; the graph's pacing is its own cost.
    config = EngineConfig(
        model=model_dir,
        dtype=dtype,
        draft=draft,
        parallel=lanes,
        kv_cache_gib=0.5,
        engine_threads=threads,
        stream_events_per_second=0.0,
    )
    loop = EngineLoop(Engine(config))
    loop.start()

    async def one(prompt: list[int], limit: int) -> StreamTimes:
        request = EngineRequest(
            request_id=f"bench-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            max_tokens=limit,
            sampling=SamplingParams(
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, ignore_eos=True
            ),
        )
        times = StreamTimes()
        start = last = time.perf_counter()
        async for chunk in loop.generate(request):
            if chunk.token_ids:
                _record(times, start, last, len(chunk.token_ids))
                last = time.perf_counter()
        return times

    try:
        return await _timed_rounds(f"engine in-process ({threads} thr)", one, rounds, max_tokens)
    finally:
        loop.shutdown()
        torch.set_num_threads(threads_before)


def replica_threads(app_args: AppArgs) -> int:
    """The intra-op threads the graph's engine computes with (deployments/model_rank/threads.py)."""
    from deployments.model_rank.threads import engine_thread_count

    return engine_thread_count(app_args.engine_threads, app_args.ingress_cpus + app_args.renderer_cpus)


def run(args: argparse.Namespace) -> int:
    if args.multi_turn:
        from serve_app.bench.turns_bench import run as run_turns

        return run_turns(args)
    rounds = _rounds(args.rounds, args.concurrency, args.prompt_tokens)
    app_args = AppArgs(model=args.model, port=args.port, parallel=args.concurrency, dtype=args.dtype, draft=args.draft)
    for name in ("stream_interval_ms", "stream_events_per_second"):
        if getattr(args, name) is not None:
            app_args = app_args.model_copy(update={name: getattr(args, name)})
    model_dir = str(app_args.model_dir)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    name, tokens = app_args.served_name, args.max_tokens
    if args.url:
        url = args.url.rstrip("/")
        graphs = [asyncio.run(_run_http(url, asyncio.run(_served_model(url)), rounds, tokens, sampling=sampling))]
    else:
        entries = HTTP_ENTRIES if args.http_entry == "both" else (args.http_entry,)
        graphs = [_run_graph_here(app_args, entry, rounds, tokens, sampling) for entry in entries]
    for peer in args.peer or []:  # measured after our graph's Ray is shut down, so they never share the cores
        graphs.append(asyncio.run(_run_http(peer.rstrip("/"), name, rounds, tokens, f"peer {peer}", sampling)))
    threads = replica_threads(app_args)
    local = asyncio.run(
        _run_in_process(model_dir, rounds, tokens, args.concurrency, threads, args.dtype, args.draft, sampling)
    )
    _print_table(local, graphs)
    return 0


def _run_graph_here(
    app_args: AppArgs, entry: HttpEntry, rounds: list[list[list[int]]], max_tokens: int, sampling: Sampling
) -> RunFigures:
    """The graph as `tensorfold serve --http-entry ENTRY` starts it, on a Ray cluster of its own."""
    init_ray(entry, app_args.port)  # before this process imports Ray: it keeps a Ray it starts on loopback
    import ray
    from ray import serve

    try:
        url = run_graph(app_args, entry, "bench")
        figures = asyncio.run(_run_http(url, app_args.served_name, rounds, max_tokens, sampling=sampling))
        figures.label = f"graph, {entry} answers"
        return figures
    finally:
        serve.shutdown()
        ray.shutdown()


def _print_table(base: RunFigures, graphs: list[RunFigures]) -> None:
    runs = [base, *graphs]
    rows = [r.row() for r in runs]
    names = list(rows[0])
    print(f"{'':26}" + "".join(f"{n:>13}" for n in names))
    for run_figures, row in zip(runs, rows):
        print(f"{run_figures.label:26}" + "".join(f"{row[n]:13.1f}" for n in names))
    for graph, row in zip(graphs, rows[1:]):
        print(
            f"{graph.label}: added TTFT p50 {row['ttft p50 ms'] - rows[0]['ttft p50 ms']:.1f} ms, "
            f"throughput {100 * (row['tok/s'] / rows[0]['tok/s'] - 1):+.1f}%"
        )
