"""The recurrent layers' depthwise causal conv in Triton (the CUDA path of recurrent_scan.causal_conv_scan).

One program per (sequence, channel tile) runs the sequence's rows in order. The last K - 1 inputs stay in
registers: read from the slot's history first, shifted by each row, copied to capture slots after captured
rows and written back last. Each output sums its taps oldest first in float32, as the reference does, so a
row's result never depends on the chunk or batch it arrives in. The window lives in named registers, so
conv widths 1 to 4 (every supported family uses 4); dispatch runs wider ones in torch.
"""

import torch

from kernels._triton import cdiv, jit, next_pow2, tl
from kernels.checks import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_last_contiguous, check_rank
from kernels.scan_meta import ScanMeta

MAX_WIDTH = 4  # taps the registers hold: three past inputs and the current row


def supports(weight: torch.Tensor) -> bool:
    """Whether this kernel takes a conv of this weight [C, K]."""
    return weight.dim() == 2 and 1 <= weight.shape[1] <= MAX_WIDTH


@jit
def _taps(h0, h1, h2, xv, w0, w1, w2, w3, HIST: tl.constexpr):
    """One output: the window (h2 the newest past input, then xv) times its taps, summed oldest first."""
    if HIST == 3:
        acc = h0 * w0
        acc = acc + h1 * w1
        acc = acc + h2 * w2
        acc = acc + xv * w3
    elif HIST == 2:
        acc = h1 * w0
        acc = acc + h2 * w1
        acc = acc + xv * w2
    elif HIST == 1:
        acc = h2 * w0
        acc = acc + xv * w1
    else:
        acc = xv * w0
    return acc


@jit
def _store_history(ptr, stride_row, h0, h1, h2, mask, HIST: tl.constexpr):
    """The window's HIST newest inputs to a slot's history rows (oldest first), in the pool's dtype."""
    dtype = ptr.dtype.element_ty
    if HIST >= 3:
        tl.store(ptr + (HIST - 3) * stride_row, h0.to(dtype), mask=mask)
    if HIST >= 2:
        tl.store(ptr + (HIST - 2) * stride_row, h1.to(dtype), mask=mask)
    if HIST >= 1:
        tl.store(ptr + (HIST - 1) * stride_row, h2.to(dtype), mask=mask)


@jit
def _load_history(ptr, stride_row, ROW: tl.constexpr, mask, HIST: tl.constexpr):
    """History row ROW counted from the newest (0); zeros where the history is shorter."""
    return tl.load(ptr + (HIST - 1 - ROW) * stride_row, mask=mask & (ROW < HIST), other=0.0)


@jit
def _conv_kernel(
    x_ptr,  # [T, C] model dtype
    history_ptr,  # [S, K - 1, C]: each slot's last inputs (advanced in place)
    weight_ptr,  # [C, K]
    bias_ptr,  # [C] (read only when HAS_BIAS)
    out_ptr,  # [T, C] float32
    starts_ptr,
    ends_ptr,
    slots_ptr,
    capture_offsets_ptr,
    capture_slots_ptr,
    channels,
    stride_xt,
    stride_hs,
    stride_hr,
    stride_wc,
    stride_wk,
    stride_ot,
    HIST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    start = tl.load(starts_ptr + seq).to(tl.int64)  # int64 rows: row * stride never wraps
    end = tl.load(ends_ptr + seq).to(tl.int64)
    if end == start:
        return
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < channels
    history = history_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_hs + c
    # Through x's dtype to float32: the reference concatenates the history to x before the taps.
    x_dtype = x_ptr.dtype.element_ty
    h0 = _load_history(history, stride_hr, 2, mask, HIST).to(x_dtype).to(tl.float32)
    h1 = _load_history(history, stride_hr, 1, mask, HIST).to(x_dtype).to(tl.float32)
    h2 = _load_history(history, stride_hr, 0, mask, HIST).to(x_dtype).to(tl.float32)
    weights = weight_ptr + c * stride_wc
    w0 = tl.load(weights, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(weights + stride_wk, mask=mask & (HIST >= 1), other=0.0).to(tl.float32)
    w2 = tl.load(weights + 2 * stride_wk, mask=mask & (HIST >= 2), other=0.0).to(tl.float32)
    w3 = tl.load(weights + 3 * stride_wk, mask=mask & (HIST >= 3), other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + c, mask=mask & HAS_BIAS, other=0.0).to(tl.float32)
    for row in range(start, end):
        xv = tl.load(x_ptr + row * stride_xt + c, mask=mask, other=0.0).to(tl.float32)
        acc = _taps(h0, h1, h2, xv, w0, w1, w2, w3, HIST)
        if HAS_BIAS:
            acc = acc + bias
        tl.store(out_ptr + row * stride_ot + c, acc, mask=mask)
        h0 = h1
        h1 = h2
        h2 = xv
        for i in range(tl.load(capture_offsets_ptr + row), tl.load(capture_offsets_ptr + row + 1)):
            target = history_ptr + tl.load(capture_slots_ptr + i).to(tl.int64) * stride_hs + c
            _store_history(target, stride_hr, h0, h1, h2, mask, HIST)
    _store_history(history, stride_hr, h0, h1, h2, mask, HIST)


def causal_conv_scan(
    x: torch.Tensor,
    history_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: ScanMeta,
    block_c: int | None = None,
) -> torch.Tensor:
    """recurrent_scan.causal_conv_scan on the step's device metadata: x [T, C], history_pool [S, K - 1, C]
    (advanced in place), weight [C, K], bias [C] or None -> [T, C] float32."""
    check_rank("x", x, 2, "[T, C]")
    check_rank("history_pool", history_pool, 3, "[slots, K - 1, C]")
    if not supports(weight):
        raise ValueError(f"weight must be [C, K] with 1 <= K <= {MAX_WIDTH}, got shape {tuple(weight.shape)}")
    channels, width = weight.shape
    check_dim("x", x, 1, channels, "channels")
    check_dim("x", x, 0, meta.total_rows, "rows")
    check_dim("history_pool", history_pool, 1, width - 1, "history rows")
    check_dim("history_pool", history_pool, 2, channels, "channels")
    for name, t in (("x", x), ("history_pool", history_pool), ("weight", weight)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_last_contiguous("x", x)
    check_last_contiguous("history_pool", history_pool)
    if bias is not None:
        check_dim("bias", bias, 0, channels, "channels")
        check_last_contiguous("bias", bias)
    named = [("x", x), ("history_pool", history_pool), ("weight", weight), ("meta", meta.starts)]
    check_device(*named, *([("bias", bias)] if bias is not None else []))
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if meta.num_seqs == 0 or channels == 0:
        return out
    block = block_c or min(next_pow2(channels), 256)
    _conv_kernel[(meta.num_seqs, cdiv(channels, block))](
        x,
        history_pool,
        weight,
        bias if bias is not None else weight,
        out,
        meta.starts,
        meta.ends,
        meta.slots,
        meta.capture_offsets,
        meta.capture_slots,
        channels,
        x.stride(0),
        history_pool.stride(0),
        history_pool.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        HIST=width - 1,
        HAS_BIAS=bias is not None,
        BLOCK_C=block,
    )
    return out
