"""GPU check: `python -m kernels.gpu_check` (one command, a few minutes on one GPU).

1. Runs the kernel tests compiled on the GPU (the same tests CI runs under the interpreter).
2. Times every kernel against its plain-torch path (and SDPA for attention) at production-like shapes,
   and against the roofline from the measured copy bandwidth and bf16 matmul throughput.
3. Measures batch invariance at production tile sizes (bitwise equality, or the largest difference).
Without CUDA it says so and exits 0; `--dry-run` runs steps 2-3 on CPU at tiny shapes (interpreter).
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
TEST_FILES = [
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: run the benchmark code on CPU at tiny shapes")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--test-timeout", type=int, default=420)
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "no CUDA device here: nothing to check (CPU coverage: pytest tests/test_kernels_*.py under the interpreter)"
        )
        return 0
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if args.dry_run:
        from kernels.testing import kernel_test_device

        kernel_test_device()  # the interpreter, with GPU-faithful bf16 dots
    else:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    tests_ok = True if args.dry_run or args.skip_tests else run_tests(args.test_timeout)
    bench_ok = benchmark(device, tiny=args.dry_run)
    invariance(device, tiny=args.dry_run)
    return 0 if tests_ok and bench_ok else 1


if __name__ == "__main__":
    sys.exit(main())
