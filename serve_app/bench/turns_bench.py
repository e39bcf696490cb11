"""`tensorfold bench serve --multi-turn`: conversations over several Scheduler replicas, prefix-affinity
routing against Serve's default (power of two choices), side by side in one run.

Each run starts the same graph (`data_parallel_size` copies) on a Ray cluster of its own, with only the
router changed, and sends the same workload: C conversations at once, each T turns in order, every turn
the whole conversation so far plus a new question. The table shows, over the turns after the first, the
share of prompt tokens found in the prefix cache (and the prompt tokens computed), the engine's time to first token (arrival at Ingress
to the first reply token, from each reply's `tensorfold` block), and the wall time of the whole workload.
"""

import argparse
import asyncio
import time
from dataclasses import dataclass

import aiohttp

from serve_app.args import AppArgs
from serve_app.launch import init_ray, run_graph

ROUTERS = ("affinity", "serve")


@dataclass
class TurnReply:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft: float  # seconds, as the engine measured it
    replica: str


@dataclass
class WorkloadFigures:
    label: str
    replies: list[TurnReply]
    wall: float

    def row(self) -> dict[str, float]:
        later = [r for r in self.replies if r.turn > 0]
        ttfts = sorted(r.ttft for r in later)
        prompt = sum(r.prompt_tokens for r in later)

        def pct(q: float) -> float:
            return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1e3 if ttfts else 0.0

        return {
            "cached %": 100.0 * sum(r.cached_tokens for r in later) / prompt if prompt else 0.0,
            "prefilled": float(sum(r.prompt_tokens - r.cached_tokens for r in later)),  # prompt tokens computed
            "ttft p50 ms": pct(0.5),
            "ttft p90 ms": pct(0.9),
            "wall s": self.wall,
            "replicas": float(len({r.replica for r in self.replies})),
        }


def opening(conversation: int, words: int) -> str:
    """A long first message, different per conversation from its first words on."""
    return f"Conversation {conversation}. " + " ".join(f"fact {conversation}-{i} holds." for i in range(words // 3))


async def _conversation(
    session: aiohttp.ClientSession, url: str, model: str, index: int, turns: int, words: int, max_tokens: int
) -> list[TurnReply]:
    messages = [{"role": "user", "content": opening(index, words)}]
    replies: list[TurnReply] = []
    for turn in range(turns):
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        async with session.post(f"{url}/chat/completions", json=body) as response:
            response.raise_for_status()
            reply = await response.json()
        usage, block = reply["usage"], reply["tensorfold"]
        replies.append(
            TurnReply(
                turn,
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                block["time_to_first_token"] or 0.0,
                block.get("replica", ""),
            )
        )
        answer = reply["choices"][0]["message"]["content"] or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And then {turn}?"}]
    return replies


async def _workload(url: str, model: str, args: argparse.Namespace) -> tuple[list[TurnReply], float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1200)) as session:
        start = time.perf_counter()
        runs = await asyncio.gather(
            *[
                _conversation(session, url, model, i, args.turns, args.prompt_tokens, args.max_tokens)
                for i in range(args.conversations)
            ]
        )
        return [reply for replies in runs for reply in replies], time.perf_counter() - start


def _run_one(app_args: AppArgs, args: argparse.Namespace) -> WorkloadFigures:
    init_ray("proxy", app_args.port)  # before this process imports Ray: it keeps a Ray it starts on loopback
    import ray
    from ray import serve

    try:
        url = run_graph(app_args, "proxy", "bench-turns")
        _wait_running()
        replies, wall = asyncio.run(_workload(url, app_args.served_name, args))
        return WorkloadFigures(f"router {app_args.router}", replies, wall)
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_running(timeout_s: float = 300.0) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get("bench-turns")
        if status is not None and status.status == "RUNNING":
            return
        time.sleep(0.5)
    raise RuntimeError("the graph did not reach RUNNING")


def run(args: argparse.Namespace) -> int:
    base = AppArgs(
        model=args.model,
        port=args.port,
        data_parallel_size=args.data_parallel_size,
        scheduler_cpus=0.2,
        ingress_cpus=0.1,
        renderer_cpus=0.1,
    )
    figures = [_run_one(base.model_copy(update={"router": router}), args) for router in ROUTERS]
    rows = [f.row() for f in figures]
    names = list(rows[0])
    print(
        f"{args.conversations} conversations x {args.turns} turns on {args.data_parallel_size} replicas; "
        "figures over the turns after the first"
    )
    print(f"{'':18}" + "".join(f"{n:>13}" for n in names))
    for run_figures, row in zip(figures, rows):
        print(f"{run_figures.label:18}" + "".join(f"{row[n]:13.1f}" for n in names))
    return 0
