"""Gated DeltaNet's recurrence in Triton (the CUDA path of recurrent_scan.gated_delta_scan).

One program per (sequence, value head, value tile) holds the state tile S [Dk, BLOCK_V] in registers across
the sequence's rows: read from the slot first, copied to capture slots after captured rows, written back
last. Each row runs the recurrent form in float32 (decay, read-out, delta update, output), never a chunked
form whose rounding would depend on where chunks fall, so a row's result is the same in any chunk or batch.
"""

import torch

from kernels._triton import cdiv, jit, next_pow2, tl
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_last_contiguous, check_rank
from kernels.scan_meta import ScanMeta, softplus


@jit
def _gated_delta_kernel(
    state_ptr,  # [S, Hv, Dk, Dv] float32 (advanced in place)
    q_ptr,  # [T, Hv, Dk]
    k_ptr,  # [T, Hv, Dk]
    v_ptr,  # [T, Hv, Dv]
    a_ptr,  # [T, Hv] (before dt_bias)
    beta_ptr,  # [T, Hv]
    neg_a_ptr,  # [Hv]: -exp(A_log)
    dt_bias_ptr,  # [Hv]
    out_ptr,  # [T, Hv, Dv] float32
    starts_ptr,
    ends_ptr,
    slots_ptr,
    capture_offsets_ptr,
    capture_slots_ptr,
    key_dim,
    value_dim,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(starts_ptr + seq).to(tl.int64)  # int64 rows: row * stride never wraps
    end = tl.load(ends_ptr + seq).to(tl.int64)
    if end == start:
        return
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = kk < key_dim, vv < value_dim
    tile = head * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    tile_mask = k_mask[:, None] & v_mask[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = tl.load(state_ptr + slot * stride_ss + tile, mask=tile_mask, other=0.0)
    neg_a = tl.load(neg_a_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    for row in range(start, end):
        a = tl.load(a_ptr + row * stride_at + head * stride_ah).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_bt + head * stride_bh).to(tl.float32)
        k = tl.load(k_ptr + row * stride_kt + head * stride_kh + kk, mask=k_mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * stride_qt + head * stride_qh + kk, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_vt + head * stride_vh + vv, mask=v_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(neg_a * softplus(a + dt_bias))
        remembered = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]
        delta = (v - remembered) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + vv, out, mask=v_mask)
        for i in range(tl.load(capture_offsets_ptr + row), tl.load(capture_offsets_ptr + row + 1)):
            target = tl.load(capture_slots_ptr + i).to(tl.int64)
            tl.store(state_ptr + target * stride_ss + tile, state, mask=tile_mask)
    tl.store(state_ptr + slot * stride_ss + tile, state, mask=tile_mask)


def _check(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    meta: ScanMeta,
) -> None:
    check_rank("state_pool", state_pool, 4, "[slots, Hv, Dk, Dv]")
    _, heads, key_dim, value_dim = state_pool.shape
    check_dtype("state_pool", state_pool, (torch.float32,))
    for name, t, size in (("q", q, key_dim), ("k", k, key_dim), ("v", v, value_dim)):
        check_rank(name, t, 3, "[T, Hv, D]")
        check_dim(name, t, 0, meta.total_rows, "rows")
        check_dim(name, t, 1, heads, "heads")
        check_dim(name, t, 2, size, "features")
        check_dtype(name, t, FLOAT_DTYPES)
        check_last_contiguous(name, t)
    for name, t in (("a", a), ("beta", beta)):
        check_rank(name, t, 2, "[T, Hv]")
        check_dim(name, t, 0, meta.total_rows, "rows")
        check_dim(name, t, 1, heads, "heads")
        check_dtype(name, t, FLOAT_DTYPES)
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias)):
        check_rank(name, t, 1, "[Hv]")
        check_dim(name, t, 0, heads, "heads")
        check_dtype(name, t, FLOAT_DTYPES)
    check_last_contiguous("state_pool", state_pool)
    named = [("state_pool", state_pool), ("q", q), ("k", k), ("v", v), ("a", a), ("beta", beta)]
    check_device(*named, ("neg_a", neg_a), ("dt_bias", dt_bias), ("meta", meta.starts))


def gated_delta_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    meta: ScanMeta,
    block_v: int | None = None,
) -> torch.Tensor:
    """recurrent_scan.gated_delta_scan on the step's device metadata: o [T, Hv, Dv] float32."""
    _check(state_pool, q, k, v, a, beta, neg_a, dt_bias, meta)
    _, heads, key_dim, value_dim = state_pool.shape
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if meta.num_seqs == 0 or heads == 0 or value_dim == 0:
        return out
    # A 128 x 16 state tile compiles without register spills at 4 warps (ptxas, sm_90); 128 x 32 spills.
    block = block_v or min(next_pow2(value_dim), 16)
    _gated_delta_kernel[(meta.num_seqs, heads, cdiv(value_dim, block))](
        state_pool,
        q,
        k,
        v,
        a,
        beta,
        neg_a,
        dt_bias,
        out,
        meta.starts,
        meta.ends,
        meta.slots,
        meta.capture_offsets,
        meta.capture_slots,
        key_dim,
        value_dim,
        state_pool.stride(0),
        state_pool.stride(1),
        state_pool.stride(2),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        a.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_K=next_pow2(key_dim),
        BLOCK_V=block,
        num_warps=4,
    )
    return out
