"""`tensorfold bench serve`: N concurrent streams through the HTTP graph and through the engine in-process.

Both runs use the same prompts and limits; the table shows TTFT and inter-token latency percentiles and
throughput side by side, so the cost the graph adds (Ray hops, HTTP, SSE framing) reads off directly.
"""

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamTimes:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # per token, between consecutive arrivals
    tokens: int = 0


@dataclass
class RunFigures:
    label: str
    streams: list[StreamTimes]
    wall: float

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




def _prompts(count: int, length: int) -> list[list[int]]:
    return [[(17 * i + 31 * j) % 200 + 10 for j in range(length)] for i in range(count)]


async def _http_stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> StreamTimes:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    times = StreamTimes()
    start = last = time.perf_counter()
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            count = sum(len(c.get("token_ids") or []) for c in choices)
            if count:
                _record(times, start, last, count)
                last = time.perf_counter()
    return times


def _record(times: StreamTimes, start: float, last: float, count: int) -> None:
    now = time.perf_counter()
    if times.tokens == 0:
        times.ttft = now - start
        count -= 1
        times.tokens = 1
    if count > 0:
        times.gaps.extend([(now - last) / count] * count)
        times.tokens += count


async def _run_http(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> RunFigures:
    async with httpx.AsyncClient(timeout=600) as client:
        await _http_stream(client, url, model, prompts[0][:8], 2)  # warm-up
        start = time.perf_counter()
        streams = await asyncio.gather(*[_http_stream(client, url, model, p, max_tokens) for p in prompts])
        return RunFigures("graph over HTTP", list(streams), time.perf_counter() - start)


async def _run_in_process(model_dir: str, prompts: list[list[int]], max_tokens: int, lanes: int) -> RunFigures:
    from deployments.config import EngineConfig
    from deployments.scheduler.engine import Engine
    from deployments.scheduler.engine_loop import EngineLoop
    from deployments.types import EngineRequest, SamplingParams

    loop = EngineLoop(Engine(EngineConfig(model=model_dir, parallel=lanes, kv_cache_gib=0.5)))
    loop.start()

    async def one(prompt: list[int], limit: int) -> StreamTimes:
        request = EngineRequest(request_id=f"bench-{uuid.uuid4().hex}", prompt_token_ids=prompt, max_tokens=limit,
                                sampling=SamplingParams(temperature=0.0, ignore_eos=True))
        times = StreamTimes()
        start = last = time.perf_counter()
        async for chunk in loop.generate(request):
            if chunk.token_ids:
                _record(times, start, last, len(chunk.token_ids))
                last = time.perf_counter()
        return times

    try:
        await one(prompts[0][:8], 2)
        start = time.perf_counter()
        streams = await asyncio.gather(*[one(p, max_tokens) for p in prompts])
        return RunFigures("engine in-process", list(streams), time.perf_counter() - start)
    finally:
        loop.shutdown()


def run(args: argparse.Namespace) -> int:
    from serve_app.args import AppArgs

    prompts = _prompts(args.concurrency, args.prompt_tokens)
    app_args = AppArgs(model=args.model, port=args.port, parallel=args.concurrency)
    for name in ("stream_interval_ms", "stream_events_per_second"):
        if getattr(args, name) is not None:
            app_args = app_args.model_copy(update={name: getattr(args, name)})
    model_dir = str(app_args.model_dir)
    if args.url:
        graph = asyncio.run(_run_http(args.url.rstrip("/"), app_args.served_name, prompts, args.max_tokens))
    else:
        graph = _run_graph_here(app_args, prompts, args.max_tokens)
    local = asyncio.run(_run_in_process(model_dir, prompts, args.max_tokens, args.concurrency))
    _print_table([local, graph])
    return 0


def _run_graph_here(app_args, prompts: list[list[int]], max_tokens: int) -> RunFigures:
    from ray import serve

    from serve_app.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": app_args.port})
    serve.run(build_app(app_args), name="bench", blocking=False, route_prefix="/")
    try:
        url = f"http://127.0.0.1:{app_args.port}/v1"
        return asyncio.run(_run_http(url, app_args.served_name, prompts, max_tokens))
    finally:
        serve.shutdown()


def _print_table(runs: list[RunFigures]) -> None:
    rows = [r.row() for r in runs]
    names = list(rows[0])
    print(f"{'':20}" + "".join(f"{n:>13}" for n in names))
    for run_figures, row in zip(runs, rows):
        print(f"{run_figures.label:20}" + "".join(f"{row[n]:13.1f}" for n in names))
    base, graph = rows
    print(f"added TTFT p50: {graph['ttft p50 ms'] - base['ttft p50 ms']:.1f} ms; "
          f"throughput change: {100 * (graph['tok/s'] / base['tok/s'] - 1):+.1f}%")
