"""The block-scaled FP8 projections' matmul, x [M, K] @ dequantized(weight [N, K])^T -> [M, N]: a
batch-invariant Triton kernel for weights kept float8_e4m3fn on CUDA (docs/checkpoints.md).

The kernel is kernels/matmul.py's, with the weight tile dequantized as it is loaded: float32(fp8) times its
block's scale, rounded to x's dtype, exactly the weight the CPU load dequantizes to (so the two paths compute
the same products). Scales come per weight row, [N, ceil(K / block_k)] float32: a checkpoint's
[ceil(N / bn), ceil(K / bk)] grid repeated over each block's rows. Same fixed tiles for every M, K summed in
ascending tiles into one float32 accumulator: a row's bits depend on that row and the weight alone.
"""

import torch

from kernels._triton import cdiv, dot_precision, jit, tl
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_rank
from kernels.matmul import BLOCK_K, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, output_for

FP8_DTYPE = torch.float8_e4m3fn


@jit(do_not_specialize=["rows"])  # one compiled kernel for every M (as kernels/matmul.py)
def _fp8_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [N, ceil(K / SCALE_K)] float32
    out_ptr,  # [M, N]
    rows,
    cols,
    depth,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_om,
    SCALE_K: tl.constexpr,
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
    s_cols = s_ptr + n.to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, depth, BLOCK_K):  # ascending K tiles, the same for every M
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < depth
        w_ok = k_ok[:, None] & n_ok[None, :]
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        q = tl.load(w_cols + k[:, None] * stride_wk, mask=w_ok, other=0.0)  # [BK, BN] fp8
        scale = tl.load(s_cols + (k // SCALE_K)[:, None], mask=w_ok, other=0.0)  # [BK, BN]
        b = (q.to(tl.float32) * scale).to(a.dtype)  # the weight as the CPU load dequantizes it
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    block_k: int,
    out: torch.Tensor | None = None,
    blocks: tuple[int, int, int] = (BLOCK_M, BLOCK_N, BLOCK_K),
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ (weight [N, K] float8_e4m3fn * scales)^T -> [M, N] in x's dtype, where
    scales [N, ceil(K / block_k)] float32 holds each row's scale per block_k columns. Row m's bits depend on
    row m, the weight and the scales alone. `blocks`: the tile (tests and timings only)."""
    _check(x, weight, scales, block_k)
    out, done = output_for(x, weight, out)
    if done:
        return out
    rows, cols = out.shape
    block_m, block_n, block_k_tile = blocks
    _fp8_matmul_kernel[(cdiv(cols, block_n), cdiv(rows, block_m))](
        x,
        weight,
        scales,
        out,
        rows,
        cols,
        x.shape[1],
        *x.stride(),
        *weight.stride(),
        scales.stride(0),
        out.stride(0),
        SCALE_K=block_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k_tile,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> None:
    check_rank("x", x, 2, "[M, K]")
    check_rank("weight", weight, 2, "[N, K]")
    check_rank("scales", scales, 2, "[N, ceil(K / block_k)]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_dtype("scales", scales, (torch.float32,))
    check_dim("x", x, 1, weight.shape[1], "input features")
    if block_k <= 0:
        raise ValueError(f"block_k must be positive, not {block_k}")
    check_dim("scales", scales, 0, weight.shape[0], "weight rows")
    check_dim("scales", scales, 1, cdiv(weight.shape[1], block_k), "column blocks")
    if scales.stride(1) != 1:
        raise ValueError("scales must be contiguous along its column blocks")
    check_device(("x", x), ("weight", weight), ("scales", scales))
