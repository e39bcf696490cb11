"""GPU check: `python -m kernels.gpu_check` (one command, minutes on one GPU, no network, no Ray).

1. Runs the kernel tests compiled on the GPU (the same tests CI runs under the interpreter).
2. Times every kernel against its plain-torch path (cuBLAS for the matmul, SDPA for attention) at
   production-like shapes, and against the roofline from the measured copy bandwidth and bf16 matmul throughput.
3. Measures batch invariance at production tile sizes (bitwise equality, or the largest difference).
4. Runs the engine phase (serve_app/bench/gpu_engine.py, in a child process: this package imports nothing
   above it): a random ~1B Qwen3-shaped checkpoint against transformers, alone = batched, warm-up, tok/s.
Without CUDA it says so and exits 0; `--dry-run` runs steps 2-4 on CPU at tiny shapes (the interpreter, and
the engine phase's tiny checkpoint).
"""

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SANITY = 5e-2  # Triton vs the bf16 torch path: both round, so looser than the tests' float64 bound; bugs give O(1)
ENGINE_TIMEOUT_S = 480  # the engine phase's bound on one H100 (it builds, loads and compiles in it)
TEST_FILES = [
    "test_kernels_matmul.py",
    "test_kernels_fp8_matmul.py",
    "test_kernels_attention.py",
    "test_kernels_mla.py",
    "test_kernels_elementwise.py",
    "test_kernels_moe.py",
    "test_kernels_dispatch.py",
    "test_kernels_recurrent.py",
]


def run_tests(timeout: int) -> bool:
    tests = [str(REPO / "tests" / "kernels" / f) for f in TEST_FILES if (REPO / "tests" / "kernels" / f).exists()]
    if not tests:
        print("kernel tests not found next to this package: skipped")
        return True
    env = {**os.environ, "TENSORFOLD_KERNEL_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO, env=env, timeout=timeout
    )
    verdict = "passed" if proc.returncode == 0 else "FAILED"
    print(f"compiled kernel tests: {verdict} in {time.perf_counter() - start:.0f} s\n")
    return proc.returncode == 0


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure_peaks(device: torch.device, tiny: bool) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured, not nominal."""
    n = 1 << (12 if tiny else 28)
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    bandwidth = 2 * n * 4 / (time_ms(lambda: dst.copy_(src), device) / 1e3)
    m = 64 if tiny else 8192
    a = torch.randn(m, m, device=device).to(torch.bfloat16)
    flops = 2 * m**3 / (time_ms(lambda: a @ a, device) / 1e3)
    return bandwidth, flops


def relative_error(out: object, ref: object) -> float | None:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return None
    diff = (out.double() - ref.double()).abs().max().item()
    return diff / max(ref.double().abs().max().item(), 1e-30)


def benchmark(device: torch.device, tiny: bool) -> bool:
    from kernels.bench_cases import all_cases

    bandwidth, flops = measure_peaks(device, tiny)
    print(
        f"measured: copy {bandwidth / 1e9:,.0f} GB/s, bf16 matmul {flops / 1e12:,.0f} TFLOP/s (the roofline's ceilings)"
    )
    header = f"{'kernel':<26}{'shape':<40}{'triton us':>10}{'torch us':>10}{'sdpa us':>9}{'vs torch':>9}"
    header += f"{'roofline us':>12}{'% roof':>7}{'rel err':>9}"
    print(header + "\n" + "-" * len(header))
    ok = True
    for build in all_cases(device, tiny):
        case = build()
        t_triton = time_ms(case.triton, device)
        times = {name: time_ms(fn, device) for name, fn in case.baselines.items()}
        roofline = max(case.bytes / bandwidth, case.flops / flops) * 1e6
        err = relative_error(case.triton(), case.baselines["torch"]())
        ok = ok and (err is None or err < SANITY)
        sdpa = f"{times['sdpa'] * 1e3:>9.1f}" if "sdpa" in times else f"{'-':>9}"
        print(
            f"{case.name:<26}{case.shape:<40}{t_triton * 1e3:>10.1f}{times['torch'] * 1e3:>10.1f}{sdpa}"
            f"{times['torch'] / t_triton:>8.1f}x{roofline:>12.1f}{100 * roofline / (t_triton * 1e3):>6.0f}%"
            f"{'-' if err is None else f'{err:.1e}':>9}"
        )
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ok


def invariance(device: torch.device, tiny: bool) -> None:
    """Bitwise checks at the production tile sizes (the tests use small tiles)."""
    from kernels.bench_cases import _paged, _rand
    from kernels.paged_decode_attention import paged_decode_attention
    from kernels.paged_meta import build_paged_meta
    from kernels.paged_prefill_attention import paged_prefill_attention

    ctx, new, hq, hkv, dim, bs = (70, 20, 4, 2, 64, 16) if tiny else (700, 200, 8, 2, 128, 16)
    tables, k_cache = _paged(1, ctx, bs, (hkv, dim), torch.bfloat16, device)
    v_cache = torch.randn_like(k_cache)
    q = _rand(new, hq, dim, dtype=torch.bfloat16, device=device)

    def prefill(rows: slice, cached: int) -> torch.Tensor:
        part = q[rows].contiguous()
        meta = build_paged_meta([part.shape[0]], [cached + part.shape[0]], tables, bs, device, row_query_limit=0)
        out = torch.empty_like(part)
        paged_prefill_attention(part, k_cache, v_cache, meta, dim**-0.5, out)
        return out

    def decode_rows(rows: slice) -> torch.Tensor:
        part = q[rows].contiguous()
        meta = build_paged_meta([part.shape[0]], [ctx - new + rows.stop], tables, bs, device)
        out = torch.empty_like(part)
        paged_decode_attention(part, k_cache, v_cache, meta, dim**-0.5, out)
        return out

    whole = prefill(slice(0, new), ctx - new)
    split = new // 3
    chunked = torch.cat([prefill(slice(0, split), ctx - new), prefill(slice(split, new), ctx - new + split)])
    last = decode_rows(slice(new - 4, new))
    print("\nbatch invariance at production tiles (max |difference|; 0 = bitwise equal):")
    print(f"  prefill whole vs in two chunks:      {(whole - chunked).abs().max().item():.3g}")
    print(f"  prefill rows vs the same decode rows: {(whole[-4:] - last).abs().max().item():.3g}")
    alone = decode_rows(slice(new - 1, new))
    print(f"  decode rows together vs one alone:    {(last[-1:] - alone).abs().max().item():.3g}")
    matmul_invariance(device, tiny)


def matmul_invariance(device: torch.device, tiny: bool) -> None:
    """A projection's rows alone and among 256 (Qwen3-1.7B's gate/up): the Triton matmul, and cuBLAS for
    contrast (the `cuda_matmul: cublas` setting)."""
    import torch.nn.functional as F

    from kernels.bench_cases import _rand
    from kernels.matmul import invariant_matmul

    cols, depth = (80, 96) if tiny else (6144, 2048)
    x = _rand(256, depth, dtype=torch.bfloat16, device=device)
    weight = _rand(cols, depth, dtype=torch.bfloat16, device=device, scale=depth**-0.5)
    for name, run in (("matmul", invariant_matmul), ("cuBLAS" if device.type == "cuda" else "torch", F.linear)):
        batch = run(x, weight)
        alone = torch.cat([run(x[i : i + 1], weight) for i in (0, 100, 255)])
        label = f"  {name} rows alone vs among 256:"
        print(f"{label:<39}{(batch[[0, 100, 255]] - alone).abs().max().item():.3g}")


def recurrent_invariance(device: torch.device, tiny: bool) -> None:
    """The recurrent kernels at production tiles (Qwen3-Next's delta rule, GLM-5.3-Flash's KDA, Nemotron-H's
    Mamba2): a sequence's outputs alone, beside a decode row, and in two chunks continuing from its slot."""
    import torch.nn.functional as F

    from kernels.gated_delta_scan import gated_delta_scan
    from kernels.kda_scan import kda_scan
    from kernels.mamba2_scan import mamba2_scan
    from kernels.recurrent_scan import ScanRows
    from kernels.scan_meta import build_scan_meta

    n, (hv, dk), (hm, p, state) = (6, (4, 16), (4, 8, 16)) if tiny else (300, (32, 128), (128, 64, 128))
    r = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    keys = [F.normalize(r(n + 1, hv, dk), dim=-1) for _ in range(2)]
    delta_rows = [*keys, r(n + 1, hv, dk), r(n + 1, hv), torch.rand(n + 1, hv, device=device)]
    delta_heads = (-r(hv).abs(), r(hv))
    mamba_rows = [r(n + 1, hm, p), r(n + 1, hm, state), r(n + 1, hm, state), r(n + 1, hm)]
    kda_rows = [
        *keys,
        r(n + 1, hv, dk),
        -torch.rand(n + 1, hv, dk, device=device),
        torch.rand(n + 1, hv, device=device),
    ]
    mamba_heads = (r(hm), -r(hm).abs(), r(hm), (0.0, float("inf")))
    kernels = [
        (
            "gated delta",
            r(2, hv, dk, dk) * 0.1,
            delta_rows,
            lambda pool, t, m: gated_delta_scan(pool, *t, *delta_heads, m),
        ),
        ("Mamba2", r(2, hm, p, state) * 0.1, mamba_rows, lambda pool, t, m: mamba2_scan(pool, *t, *mamba_heads, m)),
        ("KDA", r(2, hv, dk, dk) * 0.1, kda_rows, lambda pool, t, m: kda_scan(pool, *t, m)),
    ]
    print("\nrecurrent kernels (max |difference|; 0 = bitwise equal):")
    for name, start, inputs, run in kernels:
        pool = start.clone()

        def step(pieces: list[tuple[slice, int]]) -> torch.Tensor:
            """One launch over the pieces (rows of `inputs`, slot), in order."""
            tensors = [torch.cat([t[rows] for rows, _ in pieces]) for t in inputs]
            lengths = [rows.stop - rows.start for rows, _ in pieces]
            ends = torch.tensor(lengths).cumsum(0).tolist()
            scan = ScanRows(tuple(e - k for e, k in zip(ends, lengths)), tuple(ends), tuple(s for _, s in pieces))
            return run(pool, tensors, build_scan_meta(scan, ends[-1], device))

        alone = step([(slice(0, n), 0)])
        pool.copy_(start)
        batched = step([(slice(n, n + 1), 1), (slice(0, n), 0)])[1:]
        pool.copy_(start)
        chunked = torch.cat([step([(slice(0, n // 3), 0)]), step([(slice(n // 3, n), 0)])])
        print(
            f"  {name}: alone vs beside a decode row {(alone - batched).abs().max().item():.3g}, "
            f"vs in two chunks {(alone - chunked).abs().max().item():.3g}"
        )


def run_engine_phase(device: torch.device, size: str, timeout: int) -> bool:
    """serve_app/bench/gpu_engine.py in a child process; it prints its own summary line."""
    command = [sys.executable, "-m", "serve_app.bench.gpu_engine", "--size", size, "--device", device.type]
    print(f"\nengine phase ({size} checkpoint on {device.type}):", flush=True)
    try:
        proc = subprocess.run(command, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"engine check FAILED: still running after {timeout} s")
        return False
    return proc.returncode == 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: run steps 2-4 on CPU at tiny shapes")
    parser.add_argument("--skip-tests", action="store_true", help="leave out step 1 (the compiled kernel tests)")
    parser.add_argument("--skip-kernels", action="store_true", help="leave out steps 2-3 (timings, invariance)")
    parser.add_argument("--skip-engine", action="store_true", help="leave out step 4 (the engine phase)")
    parser.add_argument("--test-timeout", type=int, default=420)
    parser.add_argument(
        "--engine-size", choices=("1b", "tiny"), help="the engine phase's checkpoint (default: 1b, tiny with --dry-run)"
    )
    parser.add_argument("--engine-timeout", type=int, default=ENGINE_TIMEOUT_S)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "no CUDA device here: nothing to check (CPU coverage: pytest tests/kernels under the interpreter; "
            "--dry-run runs this script on CPU at tiny shapes)"
        )
        return 0
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if not args.dry_run:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    tests_ok = True if args.dry_run or args.skip_tests else run_tests(args.test_timeout)
    kernels_ok = True
    if not args.skip_kernels:
        if args.dry_run:
            from kernels.testing import kernel_test_device

            kernel_test_device()  # the interpreter, with GPU-faithful bf16 dots
        kernels_ok = benchmark(device, tiny=args.dry_run)
        invariance(device, tiny=args.dry_run)
        recurrent_invariance(device, tiny=args.dry_run)
    engine_ok = args.skip_engine or run_engine_phase(
        device, args.engine_size or ("tiny" if args.dry_run else "1b"), args.engine_timeout
    )
    return 0 if tests_ok and kernels_ok and engine_ok else 1


if __name__ == "__main__":
    sys.exit(main())
