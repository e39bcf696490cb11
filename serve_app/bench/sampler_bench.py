"""`tensorfold bench sampler`: the keyed sampler alone, the vectorised draw beside the row-by-row reference.

Both draw the same [rows, vocab] logits (a trained model's peaked rows, a random model's flat ones) with the
same settings; each case runs old and new in turn, `--repeats` times, and reports the fastest and the median
of each and whether every token agreed. On a GPU the new sampler runs on the device and
the old one is timed from the device logits as the runner used to read them: copied to the host first.
"""

import statistics
import time
from collections.abc import Callable

CASES = [
    ("greedy", dict(temperature=0.0)),
    ("T 0.8, top_p 0.95", dict(temperature=0.8, top_p=0.95)),
    ("T 0.8, top_p 0.95, top_k 20", dict(temperature=0.8, top_p=0.95, top_k=20)),
    ("T 0.8, top_p 0.95, top_k 40", dict(temperature=0.8, top_p=0.95, top_k=40)),
]


def bench_logits(rows: int, vocab: int):  # noqa: ANN201 (torch is imported when the bench runs)
    """{"peaked": ..., "flat": ...} [rows, vocab] float32: each peaked row's mass in a head of 24 tokens
    over a spread of the rest, as a trained model's; flat rows are a random model's N(0, 1)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(rows, vocab, generator=gen)
    peaked = torch.randn(rows, vocab, generator=gen) * 2 - 4
    for row in range(rows):
        peaked[row, torch.randperm(vocab, generator=gen)[:24]] += torch.linspace(14, 8, 24)
    return {"peaked": peaked, "flat": flat}


def _timed(run: Callable[[], object], sync: Callable[[], None]) -> tuple[float, object]:
    start = time.perf_counter()
    out = run()
    sync()
    return time.perf_counter() - start, out


def run(args) -> None:  # noqa: ANN001
    import torch

    from deployments.messages.step import SeqDraw
    from deployments.model_rank import keyed_reference, sampler
    from kernels import cpu_native

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(
        f"sampler bench: {args.rows} rows x {args.vocab} logits  device {device}  threads {torch.get_num_threads()}  "
        f"CPU kernels {cpu_native.level_name()}  repeats {args.repeats}  (ms; fastest / median)"
    )
    print(f"| rows | settings | logprobs | old | new | old / new | same tokens |\n|{'---|' * 7}")
    for kind, host_logits in bench_logits(args.rows, args.vocab).items():
        logits = host_logits.to(device)
        for name, settings in CASES:
            for top in (None, args.top_logprobs):
                base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0) | settings
                draws = [SeqDraw(seed=row, reply_position=17, want_logprobs=top, **base) for row in range(args.rows)]
                old, new, same = _case(
                    lambda: keyed_reference.sample_rows(logits.cpu(), draws),
                    lambda: sampler.sample_rows(logits, draws),
                    sync,
                    args.repeats,
                )
                print(f"| {kind} | {name} | {top or '-'} | {old} | {new} | {_ratio(old, new)} | {same} |")


def _case(old: Callable[[], list], new: Callable[[], list], sync: Callable[[], None], repeats: int):  # noqa: ANN202
    """Old and new in turn, after one warm-up each: their (fastest, median) and whether they agreed."""
    old(), new()
    times: dict[str, list[float]] = {"old": [], "new": []}
    agree = True
    for _ in range(repeats):
        seconds_old, old_results = _timed(old, sync)
        seconds_new, new_results = _timed(new, sync)
        times["old"].append(seconds_old)
        times["new"].append(seconds_new)
        agree = agree and [r.token for r in old_results] == [r.token for r in new_results]
    figures = [f"{min(t) * 1e3:.2f} / {statistics.median(t) * 1e3:.2f}" for t in (times["old"], times["new"])]
    return figures[0], figures[1], "yes" if agree else "NO"


def _ratio(old: str, new: str) -> str:
    fastest_old, fastest_new = float(old.split(" / ")[0]), float(new.split(" / ")[0])
    return f"{fastest_old / fastest_new:.1f}x" if fastest_new > 0 else "-"
