"""`tensorfold bench store`: a long conversation's first token, read back from the disk store against
prefilled, side by side in one run (in-process engines over the same store folder).

1. An engine with the store on prefills the prompt and writes its state while idle (the write rate).
2. A fresh engine over the same folder (a restart: nothing in RAM) answers the next turn, its state read
   back from disk; a fresh engine without the store prefills the same turn. Both report the time to the
   first token, and the restored reply must equal the prefilled one.
The break-even is the read rate above which the read-vs-prefill rule restores: the prefill rate times the
KV bytes per token.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from deployments.config import EngineConfig
from deployments.messages.engine_process import Stepped
from deployments.messages.replies import RequestStats
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.prompt_store.links import LocalStoreLink
from deployments.scheduler.engine.core import Engine
from serve_app.bench.workload import bench_checkpoint, random_prompts


def _first_token(engine: Engine, prompt: list[int], tokens: int = 4) -> tuple[float, list[int], RequestStats]:
    """Seconds from adding the request to its first reply token; the reply's ids and stats."""
    request = EngineRequest(
        f"store-bench-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0), max_tokens=tokens
    )
    started = time.perf_counter()
    first: list[float] = []

    def on_step(stepped: Stepped) -> None:
        if not first and any(chunk.token_ids for chunk in stepped.chunks):
            first.append(time.perf_counter() - started)

    reply = engine.generate([request], on_step=on_step)[request.request_id]
    assert reply.stats is not None, reply.error
    return first[0] if first else 0.0, reply.token_ids, reply.stats


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(scratch), args.size)
        base = EngineConfig(
            model=str(checkpoint),
            dtype=args.dtype,
            kv_cache_gib=2.0,
            parallel=4,
            engine_threads=torch.get_num_threads(),
            learn_dir=str(Path(scratch) / "learned"),
        )
        learned = base.model_copy(update={"learn_conversations": True})
        writer = Engine(learned, LocalStoreLink(learned))
        prompt = random_prompts(1, args.prompt_tokens, writer.runner_info.vocab_size)[0]
        first_ttft, reply, _ = _first_token(writer, prompt)
        assert writer.disk is not None
        started = time.perf_counter()
        writer.disk.write_waiting()
        write_seconds = time.perf_counter() - started
        state_bytes = writer.disk.latest.bytes_held if writer.disk.latest else 0
        writer.shutdown()
        del writer
        next_turn = prompt + reply + [11, 12, 13]
        plain = Engine(base)
        prefilled, prefilled_reply, _ = _first_token(plain, next_turn)
        plain.shutdown()
        del plain
        restarted = Engine(learned, LocalStoreLink(learned))
        restored, restored_reply, stats = _first_token(restarted, next_turn)
        disk = restarted.disk
        assert disk is not None
        bytes_per_token = disk.block_bytes / base.block_size
        break_even = disk.prefill_rate * bytes_per_token
        read_rate = disk.read_rate
        restarted.shutdown()
    print(
        f"checkpoint: {checkpoint}  threads {torch.get_num_threads()}  prompt {len(next_turn)} tokens, "
        f"state {state_bytes / 1e6:.1f} MB on disk, written in {write_seconds:.2f} s "
        f"({state_bytes / max(write_seconds, 1e-9) / 1e6:.0f} MB/s, while idle)"
    )
    print(f"{'':28}{'first token s':>15}{'cached':>9}{'from disk':>11}")
    print(f"{'prefilled (no store)':28}{prefilled:15.3f}{0:9d}{0:11d}")
    print(f"{'restored from disk':28}{restored:15.3f}{stats.cached_tokens:9d}{stats.disk_tokens:11d}")
    print(
        f"speedup {prefilled / max(restored, 1e-9):.1f}x; same reply: {restored_reply == prefilled_reply}; "
        f"first turn's prefill {first_ttft:.3f} s"
    )
    print(
        f"read-vs-prefill rule: reads at {read_rate / 1e6:.0f} MB/s measured, restores above "
        f"{break_even / 1e6:.1f} MB/s (prefill {disk.prefill_rate:.0f} tok/s x {bytes_per_token / 1e3:.1f} kB/token)"
    )
    return 0 if restored_reply == prefilled_reply else 1
