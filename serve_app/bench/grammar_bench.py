"""`tensorfold bench grammar`: decode throughput with a json_schema grammar against none, side by side.

Both runs decode the same prompts at N concurrent requests on one in-process engine, greedy with
ignore_eos, so they write the same number of tokens; the ratio is what the per-row matcher and the
logit mask cost. The schema is an open-ended array of objects, so most rows stay inside the grammar.
"""

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.messages.replies import FinishReason
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams
from deployments.scheduler.engine.core import Engine
from serve_app.bench.engine_bench import _prompts, bench_checkpoint

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


def _decode(engine: Engine, prompts: list[list[int]], decode_tokens: int, spec: GrammarSpec | None,
            label: str) -> DecodeFigures:  # fmt: skip
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(
            request_id=f"bench-{label}-{time.monotonic_ns()}-{i}", prompt_token_ids=prompt, max_tokens=decode_tokens,
            sampling=SamplingParams(temperature=0.0, ignore_eos=True), grammar=spec,
        ))  # fmt: skip
    seconds = 0.0
    tokens = 0
    texts: dict[str, str] = {}
    early = 0  # rows that ended before their limit (a grammar the model could not follow)
    while engine.has_work():
        start = time.perf_counter()
        chunks = engine.step()
        elapsed = time.perf_counter() - start
        if engine.last_step_kind == "decode":
            seconds += elapsed
            tokens += sum(len(c.token_ids) for c in chunks)
        for chunk in chunks:
            texts[chunk.request_id] = texts.get(chunk.request_id, "") + chunk.text
            if chunk.finished and chunk.finish_reason != FinishReason.LENGTH:
                early += 1
    open_rows = 0 if spec is None else sum(not _completes(t) for t in texts.values())
    return DecodeFigures(label, tokens, seconds, open_rows, early)


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
        engine = Engine(EngineConfig(model=str(checkpoint), dtype=args.dtype, kv_cache_gib=1.0,
                                     parallel=args.concurrency))  # fmt: skip
        prompts = [p[: args.prompt_tokens] for p in _prompts(args.concurrency, args.prompt_tokens,
                                                            engine.runner_info.vocab_size)]  # fmt: skip
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        engine.grammars.compile(spec)  # compiled once, outside the timed runs
        for warm_spec in (None, spec):  # both paths at full width once, untimed
            _decode(engine, prompts, 4, warm_spec, "warm")
        free = _decode(engine, prompts, args.decode_tokens, None, "unconstrained")
        constrained = _decode(engine, prompts, args.decode_tokens, spec, "json_schema")
        engine.shutdown()
    print(f"checkpoint: {checkpoint}  {args.concurrency} concurrent, {args.prompt_tokens}-token prompts, "
          f"{args.decode_tokens} tokens each, greedy")
    print(f"{'run':16} {'tokens':>8} {'decode s':>9} {'tok/s':>9} {'ended early':>12}")
    for figures in (free, constrained):
        print(f"{figures.label:16} {figures.tokens:8d} {figures.seconds:9.2f} {figures.tps:9.1f} "
              f"{figures.ended_early:12d}")
    print(f"json_schema / unconstrained: {constrained.tps / free.tps:.2f}x  "
          f"(rows still inside the grammar at the limit: {constrained.still_open}/{args.concurrency})")
    return 0
