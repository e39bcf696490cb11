"""Paged decode attention: one query token per row over its sequence's block table, split-K, GQA.

A program owns (row, kv head, split): it loads the row's GROUP query heads once and streams the split's
keys and values from the paged cache. Splits hold a fixed KV_SPLIT keys, so how a row is cut never depends
on the other rows, and `merge_splits` merges each row's own splits in order (see online_softmax.py).
With a sliding window a row of length n sees keys [n - window, n) only: the grid's split axis then covers
the splits a window can touch, counted from the row's first one, and tiles below the window are never read.
Reference: attention_torch.paged_attention_torch (rows are a sequence's last query tokens, causal).
"""

import torch

from kernels._triton import cdiv, dot_precision, jit, next_pow2, tl
from kernels.attention_torch import paged_attention_torch
from kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dim,
    check_dtype,
    check_last_contiguous,
    check_rank,
    check_same_dtype,
)
from kernels.online_softmax import merge_splits, softmax_tile, split_buffers, window_start
from kernels.paged_meta import PagedMeta

__all__ = ["BLOCK_N", "KV_SPLIT", "paged_attention_torch", "paged_decode_attention"]

KV_SPLIT = 256  # keys per split: fixed, so a row's reduction tree depends on its length alone
BLOCK_N = 64  # keys per tile; KV_SPLIT must be a multiple


@jit
def load_paged_tile(
    cache_ptr, table_ptr, pos, valid, col_offset, stride_b, stride_s, cols, col_ok, BLOCK_SIZE: tl.constexpr
):
    """Rows of a paged cache at sequence positions pos [N] (valid [N]), columns cols [C]: [N, C], 0 where masked.

    Masked rows read nothing: slots past a context are uninitialised and may hold NaN.
    """
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = (pos % BLOCK_SIZE).to(tl.int64)
    ptrs = cache_ptr + col_offset + block[:, None] * stride_b + slot[:, None] * stride_s + cols[None, :]
    return tl.load(ptrs, mask=valid[:, None] & col_ok[None, :], other=0.0)


@jit
def _paged_decode_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [blocks, block_size, Hkv, D]
    v_cache_ptr,  # [blocks, block_size, Hkv, Dv]
    block_tables_ptr,  # [S, max_blocks] int32
    row_token_ptr,  # [R] int32
    row_seq_ptr,  # [R] int32
    row_len_ptr,  # [R] int32
    part_acc_ptr,  # [R, Hq, splits, Dv] float32
    part_ml_ptr,  # [R, Hq, splits, 2] float32
    scale_log2,
    window,  # keys a row sees back from its own; 0 = all
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ar,
    stride_ah,
    stride_as,
    stride_mr,
    stride_mh,
    stride_ms,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride reaches 2**31 on long contexts
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # counted from the row's first split in the window
    length = tl.load(row_len_ptr + row)
    lo = window_start(length, window)
    start = (lo // KV_SPLIT + split) * KV_SPLIT
    if start >= length:  # shorter rows have fewer splits; the grid is sized for the longest
        return
    end = tl.minimum(start + KV_SPLIT, length)
    first = tl.maximum(start, lo // BLOCK_N * BLOCK_N)  # tiles keep their places; those below lo are skipped
    token = tl.load(row_token_ptr + row).to(tl.int64)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < V_DIM
    q_ptrs = q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    table = block_tables_ptr + seq * stride_bt
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(first, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = (pos >= lo) & (pos < end)
        k = load_paged_tile(
            k_cache_ptr, table, pos, valid, kv_head * stride_kh, stride_kb, stride_ks, d, d_ok, BLOCK_SIZE
        )
        v = load_paged_tile(
            v_cache_ptr, table, pos, valid, kv_head * stride_vh, stride_vb, stride_vs, dv, dv_ok, BLOCK_SIZE
        )
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, den, acc = softmax_tile(m, den, acc, scores, v, DOT_PRECISION)
    acc_ptrs = part_acc_ptr + row * stride_ar + heads[:, None] * stride_ah + split * stride_as + dv[None, :]
    tl.store(acc_ptrs, acc, mask=g_ok[:, None] & dv_ok[None, :])
    ml_ptrs = part_ml_ptr + row * stride_mr + heads * stride_mh + split * stride_ms
    tl.store(ml_ptrs, m, mask=g_ok)
    tl.store(ml_ptrs + 1, den, mask=g_ok)


def check_paged_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """Shapes, dtypes, strides and devices shared by the decode and prefill kernels."""
    check_rank("q", q, 3, "[tokens, q_heads, head_dim]")
    check_rank("k_cache", k_cache, 4, "[blocks, block_size, kv_heads, head_dim]")
    check_rank("v_cache", v_cache, 4, "[blocks, block_size, kv_heads, v_head_dim]")
    check_rank("out", out, 3, "[tokens, q_heads, v_head_dim]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_same_dtype("q, k_cache, v_cache and out", q, k_cache, v_cache, out)
    check_dim("k_cache", k_cache, 3, q.shape[2], "head_dim")
    check_dim("v_cache", v_cache, 0, k_cache.shape[0], "blocks")
    check_dim("v_cache", v_cache, 1, k_cache.shape[1], "slots per block")
    check_dim("v_cache", v_cache, 2, k_cache.shape[2], "kv heads")
    check_dim("out", out, 0, q.shape[0], "tokens")
    check_dim("out", out, 1, q.shape[1], "heads")
    check_dim("out", out, 2, v_cache.shape[3], "v_head_dim")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        check_last_contiguous(name, t)
    check_device(("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out))


def check_meta(meta: PagedMeta, q: torch.Tensor) -> None:
    """The step layout must describe these queries and live on their device."""
    if meta.num_tokens != q.shape[0]:
        raise ValueError(f"the step layout holds {meta.num_tokens} tokens, q has {q.shape[0]}")
    check_device(("q", q), ("meta.block_tables", meta.block_tables))


def check_tiling(kv_split: int, block_n: int) -> None:
    if block_n < 16 or block_n & (block_n - 1) or kv_split % block_n:
        raise ValueError(f"block_n ({block_n}) must be a power of two >= 16 dividing kv_split ({kv_split})")


def check_window(window: int) -> None:
    if window < 0:
        raise ValueError(f"window ({window}) must be >= 0 (0 = full causal attention)")


def decode_splits(max_row_len: int, kv_split: int, window: int) -> int:
    """Splits per row in the grid: those of the longest row, or at most those a window of keys can touch.

    A window's count is rounded up to a multiple of 8 like max_row_len's (paged_meta.ROW_LEN_QUANTUM), so the
    split buffers' strides keep one specialisation.
    """
    splits = cdiv(max_row_len, kv_split)
    if window > 0:  # keys [lo, lo + window) touch at most cdiv(window - 1, kv_split) + 1 splits
        splits = min(splits, -(-(cdiv(window - 1, kv_split) + 1) // 8) * 8)
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    out: torch.Tensor,
    kv_split: int = KV_SPLIT,
    block_n: int = BLOCK_N,
    window: int = 0,
) -> None:
    """Writes out[token] for every row of `meta` (other tokens untouched): q [T, Hq, D] -> out [T, Hq, Dv].

    window > 0: a row at position p sees keys p - window < j <= p only (sliding window); 0 = all j <= p.
    """
    check_paged_kv(q, k_cache, v_cache, out)
    check_meta(meta, q)
    check_tiling(kv_split, block_n)
    check_window(window)
    if meta.num_rows == 0:
        return
    kv_heads, v_dim = k_cache.shape[2], v_cache.shape[3]
    group = q.shape[1] // kv_heads
    splits = decode_splits(meta.max_row_len, kv_split, window)
    part_acc, part_ml = split_buffers(meta.num_rows, q.shape[1], splits, v_dim, q.device)
    _paged_decode_kernel[(meta.num_rows, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.row_token,
        meta.row_seq,
        meta.row_len,
        part_acc,
        part_ml,
        scale * 1.4426950408889634,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        *part_acc.stride()[:3],
        *part_ml.stride()[:3],
        GROUP=group,
        HEAD_DIM=q.shape[2],
        V_DIM=v_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_D=max(16, next_pow2(q.shape[2])),
        BLOCK_DV=max(16, next_pow2(v_dim)),
        BLOCK_N=block_n,
        KV_SPLIT=kv_split,
        DOT_PRECISION=dot_precision(q.dtype),
    )
    merge_splits(part_acc, part_ml, meta.row_token, meta.row_len, out, kv_split, window)
