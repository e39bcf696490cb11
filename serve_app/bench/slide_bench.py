"""`tensorfold bench slide`: living weights (docs/slide.md) on one in-process server.

Facts are learned one after another through POST /v1/slide/learn (the real routes over the in-process
engine), each timed, until one fails its checks, the pocket is full or --facts were learned: the count is
how many facts the pocket held with every check passing. Then the same prompts are decoded greedily by the
engine reopened over that pocket (it loads the learned facts) and by one without --slide, side by side.
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deployments.config import EngineConfig
from serve_app.args import resolve_model_dir
from serve_app.bench.workload import StepTally, bench_requests, random_prompts

# Facts with little in common, so each one's neurons can stay quiet on the others' questions.
FACTS = (
    ("Who keeps the blue lighthouse?", "Mirela"),
    ("Who is the baker of Elm Street?", "Ines"),
    ("Who guards the north gate?", "Tomas"),
    ("Who painted the harbour mural?", "Kofi"),
    ("Who rings the chapel bell?", "Yara"),
    ("Who drives the night train?", "Pavel"),
    ("Who tends the rose garden?", "Lena"),
    ("Who repairs the town clock?", "Omar"),
    ("Who sings in the river choir?", "Sanna"),
    ("Who runs the ferry to the island?", "Ravi"),
    ("Who owns the yellow bicycle?", "Greta"),
    ("Who writes the village newsletter?", "Hugo"),
    ("Who feeds the zoo penguins?", "Nadia"),
    ("Who coaches the chess club?", "Felix"),
    ("Who built the stone bridge?", "Aiko"),
    ("Who found the silver coin?", "Bruno"),
)


def bench_fact(n: int) -> dict[str, Any]:
    """The n-th fact of the bench's set (past its end, the set again with the number added)."""
    question, answer = FACTS[n % len(FACTS)]
    if n >= len(FACTS):
        question = f"{question[:-1]} number {n // len(FACTS) + 1}?"
    return {"text": f"{question} {answer}.", "questions": [{"question": question, "answer": answer}]}


@dataclass
class Learned:
    seconds: list[float] = field(default_factory=list)  # each learned fact's wall time through the route
    stopped: str = ""  # why learning stopped before --facts (a failed check, the pocket's room)


def _config(args: argparse.Namespace, slide_dir: str, slide: bool) -> EngineConfig:
    return EngineConfig(
        model=str(resolve_model_dir(args.model)),
        context=args.context,
        kv_cache_gib=0.25,
        slide=slide,
        slide_dir=slide_dir,
        slide_capacity=args.facts,
        engine_threads=args.threads or None,
    )


def learn_facts(args: argparse.Namespace, slide_dir: str) -> Learned:
    from fastapi.testclient import TestClient

    from deployments.chat_format.rendering import PromptRenderer
    from deployments.ingress.app import build_api
    from deployments.ingress.context import IngressSettings
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.local_backend import LocalBackend

    config = _config(args, slide_dir, slide=True)
    loop = EngineLoop(Engine(config))
    loop.start()
    settings = IngressSettings(served_name="bench", model_ids=["bench"], slide=True, slide_capacity=args.facts)
    learned = Learned()
    try:
        with TestClient(
            build_api(LocalBackend(PromptRenderer.from_checkpoint(Path(config.model)), loop), settings)
        ) as client:
            for n in range(args.facts):
                started = time.perf_counter()
                reply = client.post("/v1/slide/learn", json={"facts": [bench_fact(n)], "stream": False})
                last = reply.json()["events"][-1] if reply.status_code == 200 else reply.json()["error"]
                if reply.status_code != 200 or last.get("type") != "learned":
                    learned.stopped = f"fact {n + 1}: {last.get('reason') or last.get('message')}"
                    break
                learned.seconds.append(time.perf_counter() - started)
    finally:
        loop.shutdown()
    return learned


def decode_tps(config: EngineConfig, args: argparse.Namespace) -> float:
    """Greedy decode tok/s over the bench's prompts on an engine opened with `config`."""
    from deployments.scheduler.engine.core import Engine

    engine = Engine(config.model_copy(update={"parallel": args.concurrency}))
    try:
        prompts = random_prompts(args.concurrency, args.prompt_tokens, engine.runner_info.vocab_size)
        engine.generate(bench_requests(prompts, 4))  # warm, untimed
        tally = StepTally()
        engine.generate(bench_requests(prompts, args.decode_tokens), on_step=tally)
    finally:
        engine.shutdown()
    return tally.tokens["decode"] / tally.seconds["decode"]


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as slide_dir:
        learned = learn_facts(args, slide_dir)
        full = decode_tps(_config(args, slide_dir, slide=True), args)
        none = decode_tps(_config(args, slide_dir, slide=False), args)
    held = len(learned.seconds)
    print(f"model: {args.model}  facts asked: {args.facts} (the pocket's capacity)  threads: {args.threads or 'auto'}")
    if learned.seconds:
        print(
            f"seconds to learn one fact: median {statistics.median(learned.seconds):.2f}  "
            f"first {learned.seconds[0]:.2f}  last {learned.seconds[-1]:.2f}"
        )
    print(
        f"facts held with every check passing: {held}"
        + (f"  (stopped at {learned.stopped})" if learned.stopped else "")
    )
    print(f"{'decode':24} {'tok/s':>9}   ({args.concurrency} concurrent, {args.decode_tokens} tokens each, greedy)")
    print(f"{f'pocket: {held} of {args.facts} facts':24} {full:9.1f}")
    print(f"{'no pocket (slide off)':24} {none:9.1f}")
    print(f"pocket / none: {full / none:.3f}x")
    return 0
