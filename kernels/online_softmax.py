"""The one reduction tree every attention kernel uses, so a query's result never depends on its batch.

For one query row the keys [0, n) are cut into splits of KV_SPLIT keys (fixed, never sized from the batch),
each split into tiles of BLOCK_N keys. A split is an online softmax over its tiles in order, from an empty
state; splits are then merged in order into a running state (`merge_partial`), and the result is acc / den.
Decode kernels store each split's partial state and `merge_splits` merges them; the prefill kernel merges
in registers with the same operations. Tiles that a row cannot see, whole or in part, are exact no-ops
(their probabilities are exactly 0), so a row's result is the same whichever block of rows it shares.

With a sliding window a row sees keys [lo, n) (`window_start`). Splits and tiles keep their places counted
from key 0; those wholly below lo are skipped rather than masked (their blocks may already be freed), which
gives the same bits, since from an empty state they would have been exact no-ops too.

A state is (m: running max score, den: softmax denominator, acc: unnormalised output). Scores arrive in
log2 units (scale * log2(e) folded in), so exp2 is the only transcendental.
"""

import torch

from kernels._triton import cdiv, jit, next_pow2, tl

NEG_INF = float("-inf")


@jit
def window_start(length, window):
    """First key a query at position length - 1 sees: length - window clamped at 0, or 0 when window is 0."""
    return tl.where(window > 0, tl.maximum(length - window, 0), 0)


@jit
def softmax_tile(m, den, acc, scores, values, DOT_PRECISION: tl.constexpr):
    """Fold one tile into a split's state: m, den [M]; acc [M, Dv]; scores [M, N] (-inf = masked); values [N, Dv]."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A row with nothing visible yet keeps m = -inf; shifting by 0 then gives p = 0 instead of NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=DOT_PRECISION)
    return m_new, den, acc


@jit
def merge_partial(m_run, den_run, acc_run, m, den, acc):
    """Merge a split's state (m, den [M], acc [M, Dv]) into the running one; an empty split changes nothing."""
    m_new = tl.maximum(m_run, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_run - m_safe)
    b = tl.exp2(m - m_safe)
    return m_new, den_run * a + den * b, acc_run * a[:, None] + acc * b[:, None]


@jit
def _merge_splits_kernel(
    part_acc_ptr,  # [R, H, S, Dv] float32
    part_ml_ptr,  # [R, H, S, 2] float32: (m, den)
    row_token_ptr,  # [R] int32
    row_len_ptr,  # [R] int32
    out_ptr,  # [T, H, Dv]
    num_heads,
    window,
    stride_ar,
    stride_ah,
    stride_as,
    stride_mr,
    stride_mh,
    stride_ms,
    stride_ot,
    stride_oh,
    V_DIM: tl.constexpr,
    KV_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_DV)
    head_ok = heads < num_heads
    tile_ok = head_ok[:, None] & (dims[None, :] < V_DIM)
    length = tl.load(row_len_ptr + row)
    # Split s of a row holds its keys from split lo // KV_SPLIT + s on: splits below the window were not run.
    splits = tl.cdiv(length, KV_SPLIT) - window_start(length, window) // KV_SPLIT
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den_run = tl.zeros([BLOCK_H], tl.float32)
    acc_run = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    ml_base = part_ml_ptr + row * stride_mr + heads * stride_mh
    acc_base = part_acc_ptr + row * stride_ar + heads[:, None] * stride_ah + dims[None, :]
    for split in range(0, splits):
        m = tl.load(ml_base + split * stride_ms, mask=head_ok, other=float("-inf"))
        den = tl.load(ml_base + split * stride_ms + 1, mask=head_ok, other=0.0)
        acc = tl.load(acc_base + split * stride_as, mask=tile_ok, other=0.0)
        m_run, den_run, acc_run = merge_partial(m_run, den_run, acc_run, m, den, acc)
    den_run = tl.where(head_ok, den_run, 1.0)  # padded heads: avoid 0/0
    token = tl.load(row_token_ptr + row).to(tl.int64)
    out = acc_run / den_run[:, None]
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=tile_ok)


def split_buffers(
    rows: int, heads: int, splits: int, v_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial states for split-K: acc [R, H, S, Dv] and (m, den) [R, H, S, 2], float32 so merging is exact."""
    acc = torch.empty(rows, heads, splits, v_dim, dtype=torch.float32, device=device)
    ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=device)
    return acc, ml


def merge_splits(
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    row_token: torch.Tensor,
    row_len: torch.Tensor,
    out: torch.Tensor,
    kv_split: int,
    window: int = 0,
) -> None:
    """out[row_token[r], h] = merged splits of row r (out [T, H, Dv]); each row merges only its own splits.

    With window > 0, split s of row r holds its keys from split window_start // kv_split + s on.
    """
    rows, heads, _, v_dim = part_acc.shape
    if rows == 0:
        return
    block_dv = next_pow2(v_dim)
    block_h = max(1, min(next_pow2(heads), 4096 // block_dv))
    grid = (rows, cdiv(heads, block_h))
    _merge_splits_kernel[grid](
        part_acc,
        part_ml,
        row_token,
        row_len,
        out,
        heads,
        window,
        *part_acc.stride()[:3],
        *part_ml.stride()[:3],
        out.stride(0),
        out.stride(1),
        V_DIM=v_dim,
        KV_SPLIT=kv_split,
        BLOCK_H=block_h,
        BLOCK_DV=block_dv,
    )
