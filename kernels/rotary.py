"""Rotary position embedding on q and k in one launch: full or partial, rotate-half or interleaved pairs.

Conventions of layers/rotary.py: the first rotary_dim = 2 * len(inv_freq) features rotate, the rest pass
through. Rotate-half (Llama, Qwen, GLM-4.5 with partial_rotary_factor 0.5) pairs feature i with i + rot/2;
interleaved (GLM-4.7-Flash MLA, `rope_interleave`) pairs 2i with 2i + 1 and writes the pair de-interleaved,
to i and i + rot/2, as the reference model does. Angles are position * inv_freq in float32 (as in the
checkpoints' reference code); cos/sin are scaled by the rope type's attention factor.
"""

import torch

from kernels._triton import jit, next_pow2, tl
from kernels.checks import (
    FLOAT_DTYPES,
    check_device,
    check_dim,
    check_dtype,
    check_last_contiguous,
    check_rank,
    check_same_dtype,
    output_buffer,
)


@jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos,
    sin,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate every head of one token: x [heads, HEAD_DIM] -> out, cos/sin [BLOCK_HALF] float32."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (i[None, :] < HALF)
    src = x_ptr + token * stride_xt + h[:, None] * stride_xh
    dst = out_ptr + token * stride_ot + h[:, None] * stride_oh
    if INTERLEAVED:
        x1 = tl.load(src + 2 * i[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * i[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src + i[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst + i[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + i[None, :], out2.to(out_ptr.dtype.element_ty), mask=mask)
    if HEAD_DIM > 2 * HALF:  # partial rotary: copy the features that do not rotate
        p = tl.arange(0, BLOCK_PASS)
        pass_mask = (h[:, None] < num_heads) & (p[None, :] < HEAD_DIM - 2 * HALF)
        kept = tl.load(src + 2 * HALF + p[None, :], mask=pass_mask, other=0.0)
        tl.store(dst + 2 * HALF + p[None, :], kept, mask=pass_mask)


@jit
def _rotary_kernel(
    positions_ptr,  # [T] int64
    inv_freq_ptr,  # [HALF] float32
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,  # [T, Hq, D], [T, Hk, D]
    q_heads,
    k_heads,
    attention_scaling,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq  # float32 product, as the reference
    cos = tl.cos(angle) * attention_scaling
    sin = tl.sin(angle) * attention_scaling
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        token,
        q_heads,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        HALF,
        HEAD_DIM,
        INTERLEAVED,
        BLOCK_HQ,
        BLOCK_HALF,
        BLOCK_PASS,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        token,
        k_heads,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        HALF,
        HEAD_DIM,
        INTERLEAVED,
        BLOCK_HK,
        BLOCK_HALF,
        BLOCK_PASS,
    )


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq.to(positions.device)  # [T, rot/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, rot]
    cos = (emb.cos() * scaling).to(dtype)
    sin = (emb.sin() * scaling).to(dtype)
    return cos[:, None, :], sin[:, None, :]  # [T, 1, rot]


def mrope_cos_sin(
    positions: torch.Tensor, axes: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE's table: pair j turns with position row `axes[j]` of positions [3, T]."""
    picked = positions.float()[axes].transpose(0, 1).contiguous()  # [T, rot/2]
    freqs = picked * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, rot]
    cos = (emb.cos() * scaling).to(dtype)
    sin = (emb.sin() * scaling).to(dtype)
    return cos[:, None, :], sin[:, None, :]  # [T, 1, rot]


def rotate_with_table(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] by a cos/sin table [T, 1, rot]."""
    return _rotate_torch(q, cos, sin, False), _rotate_torch(k, cos, sin, False)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        c, s = cos[..., : rot // 2], sin[..., : rot // 2]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        half = torch.cat([-x_rot[..., rot // 2 :], x_rot[..., : rot // 2]], dim=-1)
        out = x_rot * cos + half * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def rotary_torch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/rotary.py's RotaryEmbedding.forward: q [T, Hq, D], k [T, Hk, D] -> rotated copies."""
    cos, sin = cos_sin(positions, inv_freq, attention_scaling, q.dtype)
    return _rotate_torch(q, cos, sin, interleaved), _rotate_torch(k, cos, sin, interleaved)


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor) -> None:
    check_rank("q", q, 3, "[tokens, heads, head_dim]")
    check_rank("k", k, 3, "[tokens, kv_heads, head_dim]")
    check_rank("positions", positions, 1, "[tokens]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_same_dtype("q and k", q, k)
    check_dtype("positions", positions, (torch.int64, torch.int32))
    check_dtype("inv_freq", inv_freq, (torch.float32,))
    check_dim("k", k, 0, q.shape[0], "tokens")
    check_dim("k", k, 2, q.shape[2], "features")
    check_dim("positions", positions, 0, q.shape[0], "tokens")
    if 2 * inv_freq.numel() > q.shape[2]:
        raise ValueError(f"rotary dim {2 * inv_freq.numel()} exceeds head dim {q.shape[2]}")
    for name, t in (("q", q), ("k", k), ("inv_freq", inv_freq), ("positions", positions)):
        check_last_contiguous(name, t)
    check_device(("positions", positions), ("q", q), ("k", k), ("inv_freq", inv_freq))


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rotary: same arguments and results as rotary_torch (new tensors, or q_out / k_out if given)."""
    _check(positions, q, k, inv_freq)
    q_out = output_buffer(q_out, "q_out", tuple(q.shape), q.dtype, q.device)
    k_out = output_buffer(k_out, "k_out", tuple(k.shape), k.dtype, k.device)
    half, dim = inv_freq.numel(), q.shape[2]
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            positions,
            inv_freq,
            q,
            k,
            q_out,
            k_out,
            q.shape[1],
            k.shape[1],
            float(attention_scaling),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            HALF=half,
            HEAD_DIM=dim,
            INTERLEAVED=bool(interleaved),
            BLOCK_HQ=next_pow2(q.shape[1]),
            BLOCK_HK=next_pow2(k.shape[1]),
            BLOCK_HALF=next_pow2(half),
            BLOCK_PASS=next_pow2(max(1, dim - 2 * half)),
        )
    return q_out, k_out
