"""Kimi delta attention's recurrence in Triton (the CUDA path of recurrent_scan.kda_scan).

Gated DeltaNet's kernel (gated_delta_scan.py) with the decay per key channel: one program per (sequence,
head, value tile) holds the state tile S [Dk, BLOCK_V] in registers across the sequence's rows (read from
the slot first, copied to capture slots after captured rows, written back last), and each row scales key
row i by exp(g[i]) before the delta update. The recurrent form in float32, never a chunked one, so a row's
result is the same in any chunk or batch.
"""

import torch

from kernels._triton import cdiv, jit, next_pow2, tl
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_last_contiguous, check_rank
from kernels.scan_meta import ScanMeta


@jit
def _kda_kernel(
    state_ptr,  # [S, H, Dk, Dv] float32 (advanced in place)
    q_ptr,  # [T, H, Dk]
    k_ptr,  # [T, H, Dk]
    v_ptr,  # [T, H, Dv]
    g_ptr,  # [T, H, Dk]: log-decays
    beta_ptr,  # [T, H]
    out_ptr,  # [T, H, Dv] float32
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
    stride_gt,
    stride_gh,
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
    for row in range(start, end):
        beta = tl.load(beta_ptr + row * stride_bt + head * stride_bh).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gt + head * stride_gh + kk, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_kt + head * stride_kh + kk, mask=k_mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * stride_qt + head * stride_qh + kk, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_vt + head * stride_vh + vv, mask=v_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(g)[:, None]
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
    g: torch.Tensor,
    beta: torch.Tensor,
    meta: ScanMeta,
) -> None:
    check_rank("state_pool", state_pool, 4, "[slots, H, Dk, Dv]")
    _, heads, key_dim, value_dim = state_pool.shape
    check_dtype("state_pool", state_pool, (torch.float32,))
    for name, t, size in (("q", q, key_dim), ("k", k, key_dim), ("v", v, value_dim), ("g", g, key_dim)):
        check_rank(name, t, 3, "[T, H, D]")
        check_dim(name, t, 0, meta.total_rows, "rows")
        check_dim(name, t, 1, heads, "heads")
        check_dim(name, t, 2, size, "features")
        check_dtype(name, t, FLOAT_DTYPES)
        check_last_contiguous(name, t)
    check_rank("beta", beta, 2, "[T, H]")
    check_dim("beta", beta, 0, meta.total_rows, "rows")
    check_dim("beta", beta, 1, heads, "heads")
    check_dtype("beta", beta, FLOAT_DTYPES)
    check_last_contiguous("state_pool", state_pool)
    named = [("state_pool", state_pool), ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    check_device(*named, ("meta", meta.starts))


def kda_scan(
    state_pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    meta: ScanMeta,
    block_v: int | None = None,
) -> torch.Tensor:
    """recurrent_scan.kda_scan on the step's device metadata: o [T, H, Dv] float32."""
    _check(state_pool, q, k, v, g, beta, meta)
    _, heads, key_dim, value_dim = state_pool.shape
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if meta.num_seqs == 0 or heads == 0 or value_dim == 0:
        return out
    # The state tile Gated DeltaNet's kernel found to compile without spills (128 x 16 at 4 warps, sm_90).
    block = block_v or min(next_pow2(value_dim), 16)
    _kda_kernel[(meta.num_seqs, heads, cdiv(value_dim, block))](
        state_pool,
        q,
        k,
        v,
        g,
        beta,
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
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_K=next_pow2(key_dim),
        BLOCK_V=block,
        num_warps=4,
    )
    return out
