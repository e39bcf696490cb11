"""`tensorfold bench grammar`: decode throughput with a json_schema grammar against none, side by side.

Both runs decode the same prompts at N concurrent requests on one in-process engine, greedy with
ignore_eos, so they write the same number of tokens; the ratio is what the per-row matcher and the
logit mask cost. The schema is an open-ended array of objects, so most rows stay inside the grammar.
"""

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.messages.replies import FinishReason
from deployments.messages.requests import GrammarSpec
from deployments.scheduler.engine.core import Engine
from serve_app.bench.workload import StepTally, bench_checkpoint, bench_requests, random_prompts

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "score": {"type": "integer"}, "tag": {"enum": ["a", "b", "c"]}},
        "required": ["name", "score", "tag"],
    },
}


@dataclass
class DecodeFigures:
    label: str
    tokens: int
    seconds: float
    still_open: int  # rows whose grammar had not completed when the limit cut them
    ended_early: int

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def _decode(
    engine: Engine, prompts: list[list[int]], decode_tokens: int, spec: GrammarSpec | None, label: str
) -> DecodeFigures:
    tally = StepTally()
    replies = engine.generate(bench_requests(prompts, decode_tokens, grammar=spec), on_step=tally).values()
    early = sum(reply.finish_reason != FinishReason.LENGTH for reply in replies)  # a grammar the model could not follow
    open_rows = 0 if spec is None else sum(not _completes(reply.text) for reply in replies)
    return DecodeFigures(label, tally.tokens["decode"], tally.seconds["decode"], open_rows, early)


def _completes(text: str) -> bool:
    """The reply starts with a complete JSON value (with ignore_eos, end tokens may follow it)."""
    try:
        json.JSONDecoder().raw_decode(text.lstrip())
    except json.JSONDecodeError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(scratch))
        engine = Engine(
            EngineConfig(model=str(checkpoint), dtype=args.dtype, kv_cache_gib=1.0, parallel=args.concurrency)
        )
        prompts = random_prompts(args.concurrency, args.prompt_tokens, engine.runner_info.vocab_size)
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        engine.grammars.compile(spec)  # compiled once, outside the timed runs
        for warm_spec in (None, spec):  # both paths at full width once, untimed
            _decode(engine, prompts, 4, warm_spec, "warm")
        free = _decode(engine, prompts, args.decode_tokens, None, "unconstrained")
        constrained = _decode(engine, prompts, args.decode_tokens, spec, "json_schema")
        engine.shutdown()
    print(
        f"checkpoint: {checkpoint}  {args.concurrency} concurrent, {args.prompt_tokens}-token prompts, "
        f"{args.decode_tokens} tokens each, greedy"
    )
    print(f"{'run':16} {'tokens':>8} {'decode s':>9} {'tok/s':>9} {'ended early':>12}")
    for figures in (free, constrained):
        print(
            f"{figures.label:16} {figures.tokens:8d} {figures.seconds:9.2f} {figures.tps:9.1f} "
            f"{figures.ended_early:12d}"
        )
    print(
        f"json_schema / unconstrained: {constrained.tps / free.tps:.2f}x  "
        f"(rows still inside the grammar at the limit: {constrained.still_open}/{args.concurrency})"
    )
    return 0
