"""Prefill attention over paged KV with a cached prefix: varlen causal, chunked prefill and prefix hits.

A program owns (sequence, block of BLOCK_M new tokens, query head). New token j of a sequence with C keys
after this step and Q new tokens sits at position C - Q + j and sees keys [0, C - Q + j]: its cached
prefix and the new tokens up to itself, all read from the paged cache (the new K/V are written first).
With a sliding window it sees keys [C - Q + j - window + 1, C - Q + j] only, and a block of tokens reads
no key below its first token's window.
Each row is reduced with the decode kernel's tree (same splits, tiles and merges), so where the hardware
dot product does not depend on the tile's row count a token gets the same bits either way.
"""

import torch

from kernels._triton import cdiv, dot_precision, jit, next_pow2, tl
from kernels.attention_torch import paged_attention_torch
from kernels.online_softmax import merge_partial, softmax_tile, window_start
from kernels.paged_decode_attention import (
    BLOCK_N,
    KV_SPLIT,
    check_meta,
    check_paged_kv,
    check_tiling,
    check_window,
    load_paged_tile,
)
from kernels.paged_meta import PagedMeta

BLOCK_M = 64  # new tokens per program (half that for float32: shared memory on 99 KiB GPUs)

__all__ = ["paged_attention_torch", "paged_prefill_attention"]  # the torch path is this kernel's reference


@jit
def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [blocks, block_size, Hkv, D]
    v_cache_ptr,  # [blocks, block_size, Hkv, Dv]
    out_ptr,  # [T, Hq, Dv]
    block_tables_ptr,  # [S, max_blocks] int32
    prefill_seqs_ptr,  # [P] int32
    query_starts_ptr,  # [S] int32
    query_lens_ptr,  # [S] int32
    context_lens_ptr,  # [S] int32
    scale_log2,
    window,  # keys a token sees back from its own; 0 = all
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.load(prefill_seqs_ptr + tl.program_id(0)).to(tl.int64)
    first = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + seq)
    if first >= q_len:  # the grid is sized for the longest query
        return
    ctx = tl.load(context_lens_ptr + seq)
    q_start = tl.load(query_starts_ptr + seq).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    row_len = ctx - q_len + rows + 1  # [BLOCK_M]: keys up to and including each row's own
    row_lo = window_start(row_len, window)  # [BLOCK_M]: each row's first key
    block_len = tl.minimum(ctx - q_len + first + BLOCK_M, ctx)  # keys the block's last row sees
    block_lo = window_start(ctx - q_len + first + 1, window)  # the block's first row's first key
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < V_DIM
    tokens = q_start + rows
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    table = block_tables_ptr + seq * stride_bt
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Splits and tiles keep their places counted from key 0 (the decode tree); those below block_lo are skipped.
    for s0 in range(block_lo // KV_SPLIT * KV_SPLIT, block_len, KV_SPLIT):
        s_end = tl.minimum(s0 + KV_SPLIT, block_len)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for n0 in range(tl.maximum(s0, block_lo // BLOCK_N * BLOCK_N), s_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = (pos >= block_lo) & (pos < s_end)
            k = load_paged_tile(
                k_cache_ptr, table, pos, valid, kv_head * stride_kh, stride_kb, stride_ks, d, d_ok, BLOCK_SIZE
            )
            v = load_paged_tile(
                v_cache_ptr, table, pos, valid, kv_head * stride_vh, stride_vb, stride_vs, dv, dv_ok, BLOCK_SIZE
            )
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            visible = valid[None, :] & (pos[None, :] < row_len[:, None]) & (pos[None, :] >= row_lo[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m, den, acc = softmax_tile(m, den, acc, scores, v, DOT_PRECISION)
        m_run, den_run, acc_run = merge_partial(m_run, den_run, acc_run, m, den, acc)
    den_run = tl.where(row_ok, den_run, 1.0)  # rows past the query: never stored, keep them finite
    out = acc_run / den_run[:, None]
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dv[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    out: torch.Tensor,
    kv_split: int = KV_SPLIT,
    block_n: int = BLOCK_N,
    block_m: int | None = None,
    window: int = 0,
) -> None:
    """Writes out for every token of meta.prefill_seqs (others untouched): q [T, Hq, D] -> out [T, Hq, Dv].

    window > 0: a token at position p sees keys p - window < j <= p only (sliding window); 0 = all j <= p.
    """
    check_paged_kv(q, k_cache, v_cache, out)
    check_meta(meta, q)
    check_tiling(kv_split, block_n)
    check_window(window)
    if block_m is None:
        block_m = BLOCK_M if q.element_size() <= 2 else BLOCK_M // 2
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m ({block_m}) must be a power of two >= 16")
    if meta.num_prefill == 0:
        return
    v_dim = v_cache.shape[3]
    grid = (meta.num_prefill, cdiv(meta.max_prefill_query, block_m), q.shape[1])
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.prefill_seqs,
        meta.query_starts,
        meta.query_lens,
        meta.context_lens,
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
        out.stride(0),
        out.stride(1),
        GROUP=q.shape[1] // k_cache.shape[2],
        HEAD_DIM=q.shape[2],
        V_DIM=v_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_D=max(16, next_pow2(q.shape[2])),
        BLOCK_DV=max(16, next_pow2(v_dim)),
        BLOCK_N=block_n,
        KV_SPLIT=kv_split,
        DOT_PRECISION=dot_precision(q.dtype),
    )
