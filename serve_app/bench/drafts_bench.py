"""`tensorfold bench drafts`: decode tok/s drafted against `draft: false`, side by side on one engine.

Three cases, each run drafted and serial on the same in-process engine, alternating, best of --repeats:
- MTP at batch 1: tiny-glm's scripted replies, one request at a time (its MTP layer drafts);
- n-gram at batch 1: a reply that repeats the conversation (an off-script follow-up to an off-script turn,
  whose fallback answer tiny-glm writes again);
- MTP at 16 concurrent streams: the scripted prompts together, where drafting must not cost throughput.
Only decode steps are timed (prefill is the same work either way); every pair of replies must be equal.
"""

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.scheduler.engine.core import Engine
from serve_app.args import resolve_model_dir
from serve_app.bench.workload import StepTally


@dataclass
class Decode:
    tokens: int = 0  # reply tokens written by decode rounds
    seconds: float = 0.0  # time in decode rounds
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _run(engine: Engine, requests: list[EngineRequest], together: bool) -> tuple[Decode, dict[str, list[int]]]:
    replies, tally, drafted, accepted = {}, StepTally(), 0, 0
    batches = [requests] if together else [[r] for r in requests]
    for batch in batches:
        for request_id, reply in engine.generate(batch, on_step=tally).items():
            assert reply.stats is not None, reply.error
            replies[request_id] = reply.token_ids
            drafted, accepted = drafted + reply.stats.drafted, accepted + reply.stats.accepted
    figures = Decode(tally.tokens["decode"], tally.seconds["decode"], drafted, accepted, tally.steps["decode"])
    return figures, replies


def _side_by_side(engine: Engine, requests: list[EngineRequest], together: bool, repeats: int) -> tuple[Decode, Decode]:
    """Best drafted and best serial run, alternating; raises if any reply differs."""
    best: dict[bool, Decode] = {}
    for attempt in range(repeats):
        outputs = {}
        for draft in (True, False):
            tagged = [replace(r, request_id=f"{r.request_id}-{draft}-{attempt}", draft=draft) for r in requests]
            figures, replies = _run(engine, tagged, together)
            outputs[draft] = [replies[r.request_id] for r in tagged]
            if draft not in best or figures.tps > best[draft].tps:
                best[draft] = figures
        if outputs[True] != outputs[False]:
            raise AssertionError("a drafted reply differs from its draft: false reply")
    return best[True], best[False]


def _corpus_prompts(engine: Engine) -> list[list[int]]:
    from serve_app.fixtures.tiny_glm import TEMPLATE_PATH
    from serve_app.fixtures.tiny_glm.data import corpus_examples

    return [engine.tokenizer.encode(e.prompt) for e in corpus_examples(Path(TEMPLATE_PATH).read_text())]


def _repeating_prompts(engine: Engine, count: int) -> list[list[int]]:
    """Conversations whose reply repeats an earlier assistant turn: off-script after off-script."""
    from serve_app.fixtures.tiny_glm import TEMPLATE_PATH
    from serve_app.fixtures.tiny_glm.corpus import FALLBACK_ANSWER, FALLBACK_THINKING, Conversation, assistant, user
    from serve_app.fixtures.tiny_glm.data import render_prompt

    template = Path(TEMPLATE_PATH).read_text()
    questions = [
        "Tell me about cats.",
        "Why is the sea salty?",
        "Write a poem about rain.",
        "What is a GPU?",
        "How do planes fly?",
        "Translate 'good night' to German.",
        "Who wrote Hamlet?",
        "Sort [3, 1, 2].",
    ]
    prompts = []
    for i in range(count):
        first, second = questions[i % len(questions)], questions[(i + 3) % len(questions)]
        messages = [user(first), assistant(FALLBACK_ANSWER, reasoning=FALLBACK_THINKING), user(second)]
        prompts.append(engine.tokenizer.encode(render_prompt(Conversation(f"repeat{i}", messages, ""), template)))
    return prompts


def _requests(prompts: list[list[int]], tag: str, max_tokens: int) -> list[EngineRequest]:
    greedy = SamplingParams(temperature=0.0)
    return [EngineRequest(f"{tag}{i}", p, sampling=greedy, max_tokens=max_tokens) for i, p in enumerate(prompts)]


def _engine(model: str, draft: str, args: argparse.Namespace) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            kv_cache_gib=0.25,
            parallel=32,
            draft=draft,
            draft_tokens=args.draft_tokens,
            draft_policy=args.draft_policy,
            engine_threads=args.threads or None,
        )
    )


def run(args: argparse.Namespace) -> int:
    model = str(resolve_model_dir(args.model))
    rows: list[tuple[str, Decode, Decode]] = []
    mtp = _engine(model, "mtp", args)
    prompts = _corpus_prompts(mtp)
    solo = _requests(prompts, "solo", args.max_tokens)
    rows.append(("MTP, batch 1, scripted replies", *_side_by_side(mtp, solo, False, args.repeats)))
    streams = _requests((prompts * 2)[: args.concurrency], "streams", args.max_tokens)
    rows.append((f"MTP, {args.concurrency} streams", *_side_by_side(mtp, streams, True, args.repeats)))
    ngram = _engine(model, "ngram", args)
    repeating = _requests(_repeating_prompts(ngram, 8), "repeat", args.max_tokens)
    rows.append(("n-gram, batch 1, repeating reply", *_side_by_side(ngram, repeating, False, args.repeats)))
    mtp.shutdown()
    ngram.shutdown()
    print(
        f"model: {model}  dtype {args.dtype}  threads {mtp.runner_info.threads}  policy {args.draft_policy}  greedy, "
        f"up to {args.max_tokens} tokens per reply, best of {args.repeats}"
    )
    print(f"{'case':34} {'drafted tok/s':>14} {'serial tok/s':>13} {'ratio':>7} {'acceptance':>11} {'tok/round':>10}")
    for label, drafted, serial in rows:
        acceptance = drafted.accepted / drafted.drafted if drafted.drafted else 0.0
        per_round = drafted.tokens / drafted.rounds if drafted.rounds else 0.0
        print(
            f"{label:34} {drafted.tps:14.1f} {serial.tps:13.1f} {drafted.tps / serial.tps:6.2f}x "
            f"{acceptance:11.1%} {per_round:10.2f}"
        )
    return 0
