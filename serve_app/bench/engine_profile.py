"""`tensorfold bench engine --profile`: where one engine step's time goes, by part of the forward pass.

The parts the layers call (matmuls, attention, norms and rotary, the keyed draw, the embedding) are
wrapped with wall-clock timers for the profile's run only; what is left of the runner's `execute` is the
Python around them (per layer and per step), and what is left of the step (planning, the forward pass and
writing replies: `Stepped.step_seconds`) is the scheduler's share.
Three steps are profiled: a batch-1 decode round, a 16-sequence decode round and a 512-token prefill chunk.
"""

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from deployments.messages.engine_process import Stepped
from deployments.scheduler.engine.core import Engine
from serve_app.bench.workload import bench_requests

# (category, module path, attribute): every call of module.attribute is charged to category.
TIMED: list[tuple[str, str, str]] = [
    ("matmuls", "deployments.model_rank.layers.linear", "invariant_linear"),
    ("matmuls", "deployments.model_rank.layers.embedding", "invariant_linear"),
    ("matmuls", "deployments.model_rank.layers.moe", "invariant_linear"),
    ("attention", "kernels.dispatch", "paged_attention"),
    ("attention", "kernels.dispatch", "mla_attention"),
    ("attention", "kernels.dispatch", "write_cache"),
    ("norms/rotary/act", "kernels.dispatch", "rms_norm"),
    ("norms/rotary/act", "kernels.dispatch", "add_rms_norm"),
    ("norms/rotary/act", "kernels.dispatch", "apply_rotary"),
    ("norms/rotary/act", "kernels.dispatch", "silu_mul"),
    ("recurrence", "kernels.dispatch", "causal_conv_scan"),
    ("recurrence", "kernels.dispatch", "gated_delta_scan"),
    ("recurrence", "kernels.dispatch", "mamba2_scan"),
    ("embedding", "deployments.model_rank.layers.embedding", "VocabEmbedding.forward"),
    ("sampling", "deployments.model_rank.runner", "start_draws"),
]
CATEGORIES = ["matmuls", "attention", "recurrence", "norms/rotary/act", "embedding", "sampling"]


@dataclass
class StepTimes:
    """Seconds per category over the profiled steps, plus the two enclosing totals."""

    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    execute: float = 0.0  # ModelRunner.execute: tensors in, forward, logits, draw
    step: float = 0.0  # the whole step: planning, execute, outputs
    steps: int = 0


def _resolve(path: str, attribute: str) -> tuple[Any, str]:
    import importlib

    owner: Any = importlib.import_module(path)
    *parents, name = attribute.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


def _timed(fn: Callable[..., Any], charge: Callable[[float], None]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            charge(time.perf_counter() - start)

    return wrapper


@contextmanager
def instrumented(engine: Engine, current: StepTimes) -> Iterator[None]:
    """Wrap every TIMED function and the runner's execute; each call adds its time to `current`."""
    restore: list[tuple[Any, str, Any]] = []

    def charger(category: str) -> Callable[[float], None]:
        def charge(seconds: float) -> None:
            current.parts[category] += seconds

        return charge

    def add_execute(seconds: float) -> None:
        current.execute += seconds

    seen: set[tuple[int, str]] = set()
    for category, path, attribute in TIMED:
        owner, name = _resolve(path, attribute)
        if (id(owner), name) in seen or not hasattr(owner, name):
            continue
        seen.add((id(owner), name))
        original = getattr(owner, name)
        restore.append((owner, name, original))
        setattr(owner, name, _timed(original, charger(category)))
    runner = engine.executor.runner  # type: ignore[attr-defined]
    restore.append((runner, "execute", None))
    runner.execute = _timed(runner.execute, add_execute)
    try:
        yield
    finally:
        for owner, name, original in reversed(restore):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def profile_steps(engine: Engine, prompts: list[list[int]], kind: str, count: int, rounds: int) -> StepTimes:
    """Time up to `rounds` steps of `kind` ("decode" or "prefill") with `count` sequences in flight."""
    times, current = StepTimes(), StepTimes()  # `current`: what the latest step charged

    def on_step(stepped: Stepped) -> None:
        if stepped.step_kind == kind and times.steps < rounds:
            times.step += stepped.step_seconds
            times.execute += current.execute
            for category, seconds in current.parts.items():
                times.parts[category] += seconds
            times.steps += 1
        current.parts.clear()
        current.execute = 0.0

    with instrumented(engine, current):
        requests = bench_requests(prompts[:count], max_tokens=rounds + 2 if kind == "decode" else 1)
        engine.generate(requests, on_step=on_step)
    return times


def print_profile(rows: list[tuple[str, StepTimes]]) -> None:
    print(f"{'ms per step (share)':28}" + "".join(f"{name:>24}" for name, _ in rows))

    def line(label: str, values: list[float], totals: list[float]) -> None:
        cells = "".join(f"{v * 1e3:14.2f} ({v / max(t, 1e-12):6.1%})" for v, t in zip(values, totals))
        print(f"{label:28}{cells}")

    totals = [t.step / max(t.steps, 1) for _, t in rows]
    for category in CATEGORIES:
        line(category, [t.parts.get(category, 0.0) / max(t.steps, 1) for _, t in rows], totals)
    glue = [(t.execute - sum(t.parts.values())) / max(t.steps, 1) for _, t in rows]
    line("python in the runner", glue, totals)
    line("scheduler (step - execute)", [(t.step - t.execute) / max(t.steps, 1) for _, t in rows], totals)
    line("whole step", totals, totals)
