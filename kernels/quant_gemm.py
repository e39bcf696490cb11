"""Batch-invariant matmuls over GGUF-quantized weights kept quantized on CPU (kernels/cpu/quant_gemm.c).

A weight is the bytes a GGUF file stores, one row per output feature: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K
blocks. `matmul` quantizes each activation row per block (int8 with a float32 scale of max|x| / 127, codes
rounded to nearest even), takes exact integer dot products with the weight blocks and folds each block into
a float32 sum in K order with a fixed sequence of ops (docs/engine.md, "Quantized weights"): a row's bits
depend on that row alone, and every native level computes the portable C's bits. `dequantize` and `rows`
give gguf-py's float32 values bit for bit. `python -m kernels.quant_gemm` times the kernels.
"""

from dataclasses import dataclass

import torch

from kernels import cpu_native

__all__ = ["QUANT_TYPES", "QuantType", "available", "dequantize", "matmul", "rows"]


@dataclass(frozen=True)
class QuantType:
    """A GGUF block format: `block_elems` weights stored in `block_bytes` bytes."""

    name: str
    block_elems: int
    block_bytes: int


QUANT_TYPES: dict[str, QuantType] = {
    t.name: t
    for t in (
        QuantType("Q8_0", 32, 34),
        QuantType("Q4_0", 32, 18),
        QuantType("Q4_1", 32, 20),
        QuantType("Q4_K", 256, 144),
        QuantType("Q5_K", 256, 176),
        QuantType("Q6_K", 256, 210),
    )
}
_CODES = {name: code for code, name in enumerate(QUANT_TYPES)}  # quant_blocks.h's enum


def available() -> bool:
    """Whether the native kernels are on (cpu_native.available())."""
    return cpu_native.available()


def _type(qtype: str) -> QuantType:
    if qtype not in QUANT_TYPES:
        raise ValueError(f"unknown quant type {qtype!r}: expected one of {', '.join(QUANT_TYPES)}")
    return QUANT_TYPES[qtype]


def _library():
    lib = cpu_native.library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are off (kernels.quant_gemm.available() is False)")
    return lib


def _check_weight(weight: torch.Tensor, qt: QuantType, k: int | None) -> int:
    """K of a weight [N, row_bytes] of `qt` blocks (checked against `k` where given)."""
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"weight must be a CPU uint8 [N, row_bytes] tensor, got {weight.dtype} {tuple(weight.shape)}")
    row_bytes = weight.shape[1]
    if k is not None:
        if k % qt.block_elems:
            raise ValueError(f"K={k} is not a multiple of the {qt.name} block ({qt.block_elems} weights)")
        want = k // qt.block_elems * qt.block_bytes
        if row_bytes != want:
            raise ValueError(f"weight rows hold {row_bytes} bytes; {qt.name} at K={k} needs {want}")
        return k
    if row_bytes % qt.block_bytes:
        raise ValueError(f"weight rows of {row_bytes} bytes are not whole {qt.name} blocks of {qt.block_bytes}")
    return row_bytes // qt.block_bytes * qt.block_elems


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32) @ dequantized(weight)^T -> [M, N] in x's dtype.

    weight [N, K // block_elems * block_bytes] uint8: row n is output feature n's GGUF bytes. Row m's bits
    depend on x's row m alone (not on M, the other rows or the thread count).
    """
    return _matmul(x, weight, qtype, simd=True)


def _matmul(x: torch.Tensor, weight: torch.Tensor, qtype: str, simd: bool) -> torch.Tensor:
    """matmul on this level's SIMD dot products, or (simd=False) the portable C that defines the bits."""
    qt = _type(qtype)
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [M, K] bfloat16 or float32, got {tuple(x.shape)} {x.dtype}")
    k = _check_weight(weight, qt, x.shape[1])
    lib = _library()
    n, m = weight.shape[0], x.shape[0]
    xf = x.to(torch.float32).contiguous()
    weight = weight.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        lib.tf_quant_matmul(
            xf.data_ptr(), m, k, weight.data_ptr(), n, _CODES[qt.name], out.data_ptr(), cpu_native.threads(), int(simd)
        )
    return out.to(x.dtype)


def dequantize(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """weight [N, row_bytes] uint8 of `qtype` blocks -> [N, K] float32, bitwise gguf.quants.dequantize."""
    qt = _type(qtype)
    k = _check_weight(weight, qt, None)
    return _dequantize_rows(weight, qt, k, None, weight.shape[0])


def rows(weight: torch.Tensor, qtype: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of weight [N, row_bytes] dequantized -> [T, K] float32 (a quantized embedding's lookup)."""
    qt = _type(qtype)
    k = _check_weight(weight, qt, None)
    ids = ids.to(torch.int64).reshape(-1).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        raise IndexError(f"row id out of range for a weight of {weight.shape[0]} rows")
    return _dequantize_rows(weight, qt, k, ids, ids.numel())


def _dequantize_rows(weight: torch.Tensor, qt: QuantType, k: int, ids: torch.Tensor | None, count: int):
    lib = _library()
    weight = weight.contiguous()
    out = torch.empty(count, k, dtype=torch.float32)
    if count and k:
        id_ptr = ids.data_ptr() if ids is not None else None
        lib.tf_quant_dequantize(
            weight.data_ptr(), k, _CODES[qt.name], id_ptr, count, out.data_ptr(), cpu_native.threads()
        )
    return out


def _bench_weight(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks of `qtype` with small float16 scales (codes are any bytes; timing needs no meaning)."""
    qt = QUANT_TYPES[qtype]
    blocks = torch.randint(
        0,
        256,
        (n * k // qt.block_elems, qt.block_bytes),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    scales = torch.full((blocks.shape[0], 1), 1e-3, dtype=torch.float16).view(torch.uint8)
    for at in (208,) if qtype == "Q6_K" else (0, 2) if qt.block_elems == 256 or qtype == "Q4_1" else (0,):
        blocks[:, at : at + 2] = scales
    return blocks.reshape(n, -1)


def _time(call, weights: list) -> float:
    """Seconds per call, the minimum over 5 passes over `weights`."""
    import time

    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for w in weights:
            call(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def _bench(n: int = 2048, k: int = 2048, cold_bytes: int = 96 << 20) -> None:
    """ms per call at M = 1 and 16, weights cycled through `cold_bytes` so they come from memory; the packed
    bfloat16 GEMM (kernels/cpu_gemm.py) on the same shape for scale."""
    from kernels import cpu_gemm

    print(f"level {cpu_native.level_name()}, threads {cpu_native.threads()}, N=K={n}")
    for m in (1, 16):
        x = torch.randn(m, k)
        dense = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(1, cold_bytes // (2 * n * k)))]
        for w in dense:
            cpu_gemm.pack_(w)
        xb = x.to(torch.bfloat16)
        best = _time(lambda w: cpu_gemm.matmul(xb, w), dense)
        print(f"M={m:2d} bf16: {best * 1e3:.3f} ms, {2 * n * k / best / 1e9:.1f} GB/s")
        for qtype, qt in QUANT_TYPES.items():
            size = n * k // qt.block_elems * qt.block_bytes
            weights = [_bench_weight(qtype, n, k, s) for s in range(max(1, cold_bytes // size))]
            best = _time(lambda w, qtype=qtype: matmul(x, w, qtype), weights)
            print(f"M={m:2d} {qtype}: {best * 1e3:.3f} ms, {size / best / 1e9:.1f} GB/s of blocks")


if __name__ == "__main__":
    _bench()
