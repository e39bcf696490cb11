"""Mamba2's selective state update in Triton (the CUDA path of recurrent_scan.mamba2_scan).

One program per (sequence, head, head_dim tile) holds the state tile S [BLOCK_P, N] in registers across the
sequence's rows: read from the slot first, copied to capture slots after captured rows, written back last.
Each row runs the recurrent form in float32 (never a chunked scan, whose rounding depends on where chunks
fall), so a row's result is the same in any chunk or batch. The time step is rounded to the model dtype
twice, as transformers computes it: dt + dt_bias, then its softplus.
"""

import torch

from kernels._triton import cdiv, jit, next_pow2, tl
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_last_contiguous, check_rank
from kernels.scan_meta import ScanMeta, softplus


@jit
def _mamba2_kernel(
    state_ptr,  # [S, H, P, N] float32 (advanced in place)
    x_ptr,  # [T, H, P]
    b_ptr,  # [T, H, N]
    c_ptr,  # [T, H, N]
    dt_ptr,  # [T, H] model dtype (before dt_bias)
    dt_bias_ptr,  # [H], dt's dtype
    a_ptr,  # [H]: -exp(A_log)
    d_ptr,  # [H]
    out_ptr,  # [T, H, P] float32
    starts_ptr,
    ends_ptr,
    slots_ptr,
    capture_offsets_ptr,
    capture_slots_ptr,
    head_dim,
    state_size,
    step_low,
    step_high,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_xt,
    stride_xh,
    stride_bt,
    stride_bh,
    stride_ct,
    stride_ch,
    stride_dt,
    stride_dh,
    stride_ot,
    stride_oh,
    CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(starts_ptr + seq).to(tl.int64)  # int64 rows: row * stride never wraps
    end = tl.load(ends_ptr + seq).to(tl.int64)
    if end == start:
        return
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    p_mask, n_mask = pp < head_dim, nn < state_size
    tile = head * stride_sh + pp[:, None] * stride_sp + nn[None, :]
    tile_mask = p_mask[:, None] & n_mask[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = tl.load(state_ptr + slot * stride_ss + tile, mask=tile_mask, other=0.0)
    step_dtype = dt_ptr.dtype.element_ty
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)
    for row in range(start, end):
        dt = tl.load(dt_ptr + row * stride_dt + head * stride_dh).to(tl.float32)
        step = (dt + dt_bias).to(step_dtype).to(tl.float32)
        step = softplus(step).to(step_dtype).to(tl.float32)
        if CLAMP:
            step = tl.minimum(tl.maximum(step, step_low), step_high)
        x = tl.load(x_ptr + row * stride_xt + head * stride_xh + pp, mask=p_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_bt + head * stride_bh + nn, mask=n_mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + row * stride_ct + head * stride_ch + nn, mask=n_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(step * a)
        state = state + (x * step)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + d * x
        tl.store(out_ptr + row * stride_ot + head * stride_oh + pp, y, mask=p_mask)
        for i in range(tl.load(capture_offsets_ptr + row), tl.load(capture_offsets_ptr + row + 1)):
            target = tl.load(capture_slots_ptr + i).to(tl.int64)
            tl.store(state_ptr + target * stride_ss + tile, state, mask=tile_mask)
    tl.store(state_ptr + slot * stride_ss + tile, state, mask=tile_mask)


def _check(
    state_pool: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    meta: ScanMeta,
) -> None:
    check_rank("state_pool", state_pool, 4, "[slots, H, P, N]")
    _, heads, head_dim, state_size = state_pool.shape
    check_dtype("state_pool", state_pool, (torch.float32,))
    check_last_contiguous("state_pool", state_pool)
    for name, t, size in (("x", x, head_dim), ("b", b, state_size), ("c", c, state_size)):
        check_rank(name, t, 3, "[T, H, D]")
        check_dim(name, t, 0, meta.total_rows, "rows")
        check_dim(name, t, 1, heads, "heads")
        check_dim(name, t, 2, size, "features")
        check_dtype(name, t, FLOAT_DTYPES)
        check_last_contiguous(name, t)
    check_rank("dt", dt, 2, "[T, H]")
    check_dim("dt", dt, 0, meta.total_rows, "rows")
    check_dim("dt", dt, 1, heads, "heads")
    for name, t in (("dt", dt), ("dt_bias", dt_bias), ("a", a), ("d", d)):
        check_dtype(name, t, FLOAT_DTYPES)
    for name, t in (("dt_bias", dt_bias), ("a", a), ("d", d)):
        check_rank(name, t, 1, "[H]")
        check_dim(name, t, 0, heads, "heads")
    named = [("state_pool", state_pool), ("x", x), ("b", b), ("c", c), ("dt", dt), ("dt_bias", dt_bias)]
    check_device(*named, ("a", a), ("d", d), ("meta", meta.starts))


def mamba2_scan(
    state_pool: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    time_step_limit: tuple[float, float],
    meta: ScanMeta,
    block_p: int | None = None,
) -> torch.Tensor:
    """recurrent_scan.mamba2_scan on the step's device metadata: y [T, H, P] float32."""
    _check(state_pool, x, b, c, dt, dt_bias, a, d, meta)
    _, heads, head_dim, state_size = state_pool.shape
    step_dtype = torch.promote_types(dt.dtype, dt_bias.dtype)  # dt + dt_bias is rounded to it
    dt, dt_bias = dt.to(step_dtype), dt_bias.to(step_dtype)
    low, high = time_step_limit
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if meta.num_seqs == 0 or heads == 0 or head_dim == 0:
        return out
    # An 8 x 128 state tile takes ~100 registers at 4 warps (ptxas, sm_90), 16 x 128 ~170: more programs resident.
    block = block_p or min(next_pow2(head_dim), 8)
    _mamba2_kernel[(meta.num_seqs, heads, cdiv(head_dim, block))](
        state_pool,
        x,
        b,
        c,
        dt,
        dt_bias,
        a,
        d,
        out,
        meta.starts,
        meta.ends,
        meta.slots,
        meta.capture_offsets,
        meta.capture_slots,
        head_dim,
        state_size,
        float(low),
        float(high),
        state_pool.stride(0),
        state_pool.stride(1),
        state_pool.stride(2),
        x.stride(0),
        x.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        dt.stride(0),
        dt.stride(1),
        out.stride(0),
        out.stride(1),
        CLAMP=low > 0.0 or high != float("inf"),
        BLOCK_P=block,
        BLOCK_N=next_pow2(state_size),
        num_warps=4,
    )
    return out
