"""The projections' matmul, x [M, K] @ weight [N, K]^T -> [M, N]: a batch-invariant Triton kernel for CUDA
beside the torch path it replaces there (the CPU path, and CUDA with `cuda_matmul: cublas`).

cuBLAS picks its kernel (tile shape, split-K, reduction order) by the problem's size, so a row's bits change
with the number of rows sharing the call. Here one compiled kernel serves every M: fixed BLOCK_M x BLOCK_N
output tiles, each summed over K in BLOCK_K tiles in ascending order into one float32 accumulator (no
split-K, no atomics), M passed unspecialised. An output element is one fixed sequence of ops whatever M, the
other rows or its row's place in its tile (docs/engine.md, On CUDA: the Triton kernels).
"""

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, dot_precision, jit, tl
from kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dim,
    check_dtype,
    check_rank,
    check_same_dtype,
    output_buffer,
)

# One tile shape for every M, dtype and device (changing it per M would change a row's bits). Not yet tuned
# on a GPU: `python -m kernels.gpu_check` times it against cuBLAS.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3

TILE_ROWS = 16  # the torch path's GEMMs run on row counts that are multiples of this (CPU, and float32 anywhere)
CALL_ROWS = 256  # ... at most this many rows per GEMM call (past it MKL's kernel choice changes the bits)


@jit(do_not_specialize=["rows"])  # M == 1 or M % 16 == 0 would otherwise compile other kernels
def _matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    rows,
    cols,
    depth,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < rows, n < cols
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, depth, BLOCK_K):  # ascending K tiles, the same for every M
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < depth
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def output_for(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """x [M, K] @ weight [N, K]^T's output buffer, and whether it is already the answer (no rows, columns or K)."""
    out = output_buffer(out, "out", (x.shape[0], weight.shape[0]), x.dtype, x.device)
    if out.numel() == 0:
        return out, True
    if x.shape[1] == 0:
        return out.zero_(), True
    return out, False


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    blocks: tuple[int, int, int] = (BLOCK_M, BLOCK_N, BLOCK_K),
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (bf16, fp16 or fp32; float32 accumulation); row m's
    bits depend on row m and the weight alone. `blocks`: the tile (tests and timings only)."""
    _check(x, weight)
    out, done = output_for(x, weight, out)
    if done:
        return out
    rows, cols = out.shape
    block_m, block_n, block_k = blocks
    _matmul_kernel[(cdiv(cols, block_n), cdiv(rows, block_m))](
        x,
        weight,
        out,
        rows,
        cols,
        x.shape[1],
        *x.stride(),
        *weight.stride(),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_rank("x", x, 2, "[M, K]")
    check_rank("weight", weight, 2, "[N, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_same_dtype("x and weight", x, weight)
    check_dim("x", x, 1, weight.shape[1], "input features")
    check_device(("x", x), ("weight", weight))


def matmul_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch path: x [M, K] @ weight [N, K]^T -> [M, N]. CPU GEMMs pick kernels by row count (float32's
    M=1..3 differ from M>=4; bf16 without AMX gives a lone row, a GEMV, and for small shapes up to 4 rows,
    other bits than 8 or more), so CPU GEMMs and float32 anywhere run in zero-padded TILE_ROWS-row tiles,
    CALL_ROWS per call at most: the one row count measured invariant for every dtype and shape tried. Other
    CUDA GEMMs are one cuBLAS call, which does not keep a row's bits across batches."""
    if (x.dtype == torch.float32 or x.device.type == "cpu") and x.shape[0] > 0:
        return _tiled_matmul(x, weight)
    return F.linear(x, weight)


def _tiled_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M, N] on zero-padded whole tiles, CALL_ROWS rows per GEMM at most."""
    rows = x.shape[0]
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    if padded <= CALL_ROWS:
        return F.linear(x, weight)[:rows]
    return torch.cat([F.linear(part, weight) for part in x.split(CALL_ROWS)])[:rows]
