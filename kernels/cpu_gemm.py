"""Batch-invariant bfloat16 matmuls, the CPU path's projections: on Intel AMX (kernels/cpu/amx_gemm.c), at
the avx512 level on AVX-512 BF16 (kernels/cpu/avx512_gemm.c), at the avx2 and neon levels with bfloat16
widened to fp32 and FMA (kernels/cpu/fma_gemm.c).

torch's bfloat16 GEMMs on CPU read weights at 8-20 GB/s for the 1-16 rows of a decode step, and oneDNN's
prepacked kernels change a row's bits with the row count at larger K. Here each output element is one
fixed sequence of ops over K (AMX tile ops, VDPBF16PS over pairs of K, or one FMA per element of K), whatever
M, the N split or the thread count, and one row streams the weights near memory bandwidth. Weights are packed
in place once at load (`pack_`, kernels/cpu/bf16_pack.h over each GEMM's layout; avx512 and avx2 share
pair_pack.h's).
"""

import torch

from kernels import cpu_native
from kernels.cpu_native import available

__all__ = ["available", "can_pack", "is_packed", "matmul", "pack_", "rows"]

TILE_N, TILE_K = 16, 32  # the pack's tile: W rows (output features) by K elements
GROUP_ROWS = 4 * TILE_N  # W rows per group of tiles (bf16_pack.h's GROUP_N): packs of whole groups concatenate


def can_pack(weight: torch.Tensor) -> bool:
    """A CPU bfloat16 weight [N, K] (or a stack [E, N, K]) whose pack fits its own storage."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() in (2, 3)
        and weight.is_contiguous()
        and weight.shape[-2] % TILE_N == 0
        and weight.shape[-1] % TILE_K == 0
    )


def pack_(weight: torch.Tensor) -> None:
    """Rewrite `weight` [N, K] or [E, N, K] in place into the kernel's layout and mark it packed.

    Afterwards its elements are no longer in row order: read it only through `matmul` and `rows`.
    """
    lib = cpu_native.library()
    if lib is None or not can_pack(weight) or is_packed(weight):
        raise ValueError("pack_ needs the native kernels and an unpacked contiguous bf16 weight with N%16 == K%32 == 0")
    n, k = weight.shape[-2], weight.shape[-1]
    with torch.no_grad():
        for matrix in weight.reshape(-1, n, k):
            original = matrix.clone()
            lib.tf_bf16_pack(original.data_ptr(), n, k, k, matrix.data_ptr())
    weight.bf16_packed = True


def is_packed(weight: torch.Tensor) -> bool:
    """A packed weight, or one whole matrix of a packed stack (`stack[e]`)."""
    if getattr(weight, "bf16_packed", False):
        return True
    base = weight._base
    return (
        base is not None
        and getattr(base, "bf16_packed", False)
        and base.dim() == 3
        and weight.shape == base.shape[1:]
        and weight.is_contiguous()
    )


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ packed weight [N, K]^T -> [M, N] bf16; row m's bits depend on row m alone."""
    lib = cpu_native.library()
    assert lib is not None and is_packed(weight)
    n, k = weight.shape
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] bfloat16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m == 0:
        return out
    chosen = cpu_native.level()
    if chosen is cpu_native.AMX:
        panels = torch.empty(-(-m // 16) * 16 * k, dtype=torch.bfloat16)  # x copied into zero-padded 16-row panels
        lib.tf_amx_gemm(
            x.data_ptr(), m, k, k, weight.data_ptr(), n, out.data_ptr(), n, panels.data_ptr(), cpu_native.threads()
        )
    elif chosen is cpu_native.AVX512:
        lib.tf_avx512_gemm(x.data_ptr(), m, k, k, weight.data_ptr(), n, out.data_ptr(), n, cpu_native.threads())
    else:
        lib.tf_fma_gemm(x.data_ptr(), m, k, k, weight.data_ptr(), n, out.data_ptr(), n, cpu_native.threads())
    return out


def rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of a packed weight [N, K] in their original order -> [T, K] (a tied embedding's lookup)."""
    lib = cpu_native.library()
    assert lib is not None and is_packed(weight)
    n, k = weight.shape
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"token id out of range for an embedding of {n} rows")
    out = torch.empty(ids.shape[0], k, dtype=weight.dtype)
    lib.tf_bf16_unpack_rows(weight.data_ptr(), n, k, ids.data_ptr(), ids.shape[0], out.data_ptr())
    return out
