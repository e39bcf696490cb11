"""Compile every kernel for NVIDIA GPUs ahead of time, without a GPU: `python -m kernels.compile_check`.

The interpreter runs kernels as numpy code, so it accepts things the compiler rejects (a loop variable
changing type, a dot smaller than 16, shared memory past the limit). This runs the kernel wrappers on CPU
tensors at production-like shapes, but instead of launching, compiles each launch's specialisation to a
cubin for the requested architectures (Triton's bundled ptxas; no driver needed) and reports its shared
memory. Needs TRITON_INTERPRET=0, which it sets when run as a script (before Triton is imported).
"""

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # opt-in max per block, bytes
TYPE_NAMES = {
    "float8_e4m3fn": "fp8e4nv",
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "int32": "i32",
    "int64": "i64",
}


def arg_type(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + TYPE_NAMES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for argument {value!r}")


class Compiler:
    """Stands in for kernel launches: compiles each distinct specialisation once per architecture."""

    def __init__(self, archs: list[int]) -> None:
        self.archs = archs
        self.seen: set[tuple] = set()
        self.rows: list[tuple[str, str, int, float, int]] = []  # kernel, dtypes, arch, seconds, shared bytes
        self.failures: list[str] = []

    def launch(self, fn: Any, args: tuple, kwargs: dict) -> None:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(fn.arg_names, args)) | kwargs
        signature, constexprs = {}, {}
        for param in fn.params:
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            else:
                signature[param.name] = arg_type(value)
        key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())))
        if key in self.seen:
            return
        self.seen.add(key)
        dtypes = ",".join(
            sorted({t[1:] for t in signature.values() if t.startswith("*") and t[1:] not in ("i32", "i64")})
        )
        for arch in self.archs:
            start = time.perf_counter()
            try:
                src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            except Exception as exc:  # report every failure, not just the first
                self.failures.append(f"{fn.__name__} [{dtypes}] sm_{arch}: {type(exc).__name__}: {exc}".splitlines()[0])
                continue
            shared = int(compiled.metadata.shared)
            self.rows.append((fn.__name__, dtypes, arch, time.perf_counter() - start, shared))
            if shared > SHARED_LIMIT.get(arch, 99 * 1024):
                self.failures.append(f"{fn.__name__} [{dtypes}] sm_{arch}: {shared} bytes of shared memory")


def intercept(compiler: Compiler) -> None:
    """Route every kernel launch to the compiler and let the wrappers accept CPU tensors."""
    from triton.runtime.jit import JITFunction

    import kernels.checks

    def getitem(self: Any, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: compiler.launch(self, args, kwargs)

    JITFunction.__getitem__ = getitem
    original = kernels.checks.check_device
    for name, module in list(sys.modules.items()):
        if name.startswith("kernels.") and getattr(module, "check_device", None) is original:
            module.check_device = lambda *named: None


def exercise(dtype: Any, quick: bool) -> None:
    """Call every wrapper at production-like shapes (Llama/Qwen/GLM attention, GLM-4.7-Flash MLA);
    `quick`: one shape per kernel."""
    import torch

    from kernels import fp8_matmul, fused_moe, kv_write, matmul, mla_decode, moe_routing, rmsnorm, rotary
    from kernels.causal_conv_scan import causal_conv_scan
    from kernels.gated_delta_scan import gated_delta_scan
    from kernels.kda_scan import kda_scan
    from kernels.mamba2_scan import mamba2_scan
    from kernels.paged_decode_attention import paged_decode_attention
    from kernels.paged_meta import build_paged_meta
    from kernels.paged_prefill_attention import paged_prefill_attention
    from kernels.recurrent_scan import ScanRows
    from kernels.scan_meta import build_scan_meta

    t = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt)  # noqa: E731
    matmul.invariant_matmul(t(16, 2048), t(6144, 2048))  # every projection and the lm_head: one kernel per dtype
    fp8_weight, fp8_scales = t(6144, 2048, dt=torch.float8_e4m3fn), t(6144, 16, dt=torch.float32)
    fp8_matmul.fp8_matmul(t(16, 2048), fp8_weight, fp8_scales, 128)  # projections kept block-scaled fp8
    tables = [[0, 1, 2, 3]]
    for heads, kv_heads, dim in ((32, 8, 128), (16, 16, 64), (8, 1, 128))[: 1 if quick else 3]:
        meta = build_paged_meta([40], [60], tables, 16, torch.device("cpu"), row_query_limit=0)
        k_cache, v_cache = t(4, 16, kv_heads, dim), t(4, 16, kv_heads, dim)
        paged_prefill_attention(t(40, heads, dim), k_cache, v_cache, meta, 0.1, t(40, heads, dim))
        meta = build_paged_meta([1], [60], tables, 16, torch.device("cpu"))
        paged_decode_attention(t(1, heads, dim), k_cache, v_cache, meta, 0.1, t(1, heads, dim))
        kv_write.write_cache(k_cache, t(3, kv_heads, dim), torch.zeros(3, dtype=torch.long))
    meta = build_paged_meta([1], [60], tables, 16, torch.device("cpu"), row_query_limit=2**31 - 1)
    mla_decode.mla_attention_triton(t(1, 20, 192), t(1, 20, 64), t(4, 16, 576), meta, 0.1, t(20 * 448, 512), 256)
    kv_write.write_cache(t(4, 16, 576), t(3, 576), torch.zeros(3, dtype=torch.long))
    for hidden in (2048, 5120)[: 1 if quick else 2]:
        rmsnorm.rms_norm(t(2, hidden), t(hidden, dt=torch.float32), 1e-5)
        rmsnorm.add_rms_norm(t(2, hidden), t(2, hidden), t(hidden), 1e-5)
    positions = torch.zeros(2, dtype=torch.long)
    rotary.rotary(positions, t(2, 32, 128), t(2, 8, 128), torch.ones(32), 1.0, False)  # GLM partial 0.5
    rotary.rotary(positions, t(2, 20, 64), t(2, 1, 64), torch.ones(32), 1.0, True)  # MLA interleaved
    for experts, top_k, groups in ((160, 8, 1), (64, 4, 8))[: 1 if quick else 2]:
        logits = torch.zeros(2, experts)
        moe_routing.grouped_topk(logits, torch.zeros(experts), top_k, groups, min(groups, 3), True, 2.5)
        ids = torch.arange(2 * top_k).view(2, top_k) % experts
        fused_moe.fused_moe(
            t(2, 2048),
            torch.ones(2, top_k),
            ids,
            t(experts, 1536, 2048),
            t(experts, 1536, 2048),
            t(experts, 2048, 1536),
        )
    # Recurrent layers: Qwen3-Next's Gated DeltaNet (conv 8192 wide, 32 value heads of 128) and Nemotron-H's
    # Mamba2 (conv 10240 wide, 128 heads of 64, state 128); a prefill row, a decode row, one capture.
    rows = build_scan_meta(ScanRows((0, 3), (3, 4), (0, 1), ((1, 2),)), 4, torch.device("cpu"))
    f32 = torch.float32
    for conv_dim, bias in ((8192, False), (10240, True))[: 1 if quick else 2]:
        causal_conv_scan(t(4, conv_dim), t(3, 3, conv_dim), t(conv_dim, 4), t(conv_dim) if bias else None, rows)
    q = t(4, 32, 128, dt=f32)
    gated_delta_scan(t(3, 32, 128, 128, dt=f32), q, q, q, t(4, 32), t(4, 32, dt=f32), t(32, dt=f32), t(32), rows)
    kda_scan(t(3, 32, 128, 128, dt=f32), q, q, q, q, t(4, 32, dt=f32), rows)  # GLM-5.3-Flash: a decay per channel
    x, bc, heads = t(4, 128, 64, dt=f32), t(4, 128, 128, dt=f32), t(128, dt=f32)
    mamba2_scan(t(3, 128, 64, 128, dt=f32), x, bc, bc, t(4, 128), t(128), heads, heads, (0.0, float("inf")), rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90", help="comma-separated compute capabilities, e.g. 80,90")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or "triton" in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"
        if "triton" in sys.modules:
            print(
                "Triton was already imported (maybe in interpreter mode): run this as `python -m kernels.compile_check`"
            )
            return 2
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    compiler = Compiler([int(a) for a in args.arch.split(",")])
    import kernels.dispatch  # noqa: F401  (imports every kernel module, compiled flavour)

    intercept(compiler)
    for name in args.dtypes.split(","):
        exercise(getattr(torch, name), args.quick)
    print(f"{'kernel':<26} {'dtypes':<12} {'arch':>5} {'compile s':>9} {'shared KiB':>10}")
    for kernel, dtypes, arch, seconds, shared in compiler.rows:
        print(f"{kernel:<26} {dtypes:<12} {'sm_' + str(arch):>5} {seconds:>9.2f} {shared / 1024:>10.1f}")
    for failure in compiler.failures:
        print("FAILED", failure)
    return 1 if compiler.failures else 0


if __name__ == "__main__":
    sys.exit(main())
