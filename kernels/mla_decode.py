"""MLA attention (glm4_moe_lite, DeepSeek-V3) over the compressed latent cache, projections absorbed.

The layer expands every cached latent c [C] to per-head keys k_h = [W_UK_h c, k_rope] and values W_UV_h c
(W_UK_h, W_UV_h: head h's rows of kv_b_proj). Absorbed, the same scores and outputs are
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_rope,    out_h = W_UV_h (sum_t p_t c_t),
so the kernel attends all heads at once over the latent rows themselves (one [C + R] row per key, read
once for scores and values) and never materialises per-head K/V. Every query token is a row with its own
key count, so decode and drafted tokens share one program shape; splits follow online_softmax.py.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, dot_precision, jit, next_pow2, tl
from kernels.attention_torch import causal_attention, gather_cache, sequence_spans
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
from kernels.online_softmax import merge_splits, softmax_tile, split_buffers
from kernels.paged_decode_attention import BLOCK_N, KV_SPLIT, check_meta, check_tiling, load_paged_tile
from kernels.paged_meta import PagedMeta

BLOCK_H = 16  # heads per program (the dot's M dimension)


@jit
def _mla_decode_kernel(
    q_lat_ptr,  # [T, H, C]: absorbed no-rope queries
    q_rope_ptr,  # [T, H, R]
    cache_ptr,  # [blocks, block_size, C + R]
    block_tables_ptr,  # [S, max_blocks] int32
    row_token_ptr,  # [R] int32
    row_seq_ptr,  # [R] int32
    row_len_ptr,  # [R] int32
    part_acc_ptr,  # [R, H, splits, C] float32
    part_ml_ptr,  # [R, H, splits, 2] float32
    scale_log2,
    num_heads,
    stride_qt,
    stride_qh,
    stride_rt,
    stride_rh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ar,
    stride_ah,
    stride_as,
    stride_mr,
    stride_mh,
    stride_ms,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    length = tl.load(row_len_ptr + row)
    start = split * KV_SPLIT
    if start >= length:
        return
    end = tl.minimum(start + KV_SPLIT, length)
    token = tl.load(row_token_ptr + row).to(tl.int64)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    h_ok = heads < num_heads
    c = tl.arange(0, BLOCK_C)
    c_ok = c < LATENT
    r = tl.arange(0, BLOCK_R)
    r_ok = r < ROPE
    q_lat = tl.load(
        q_lat_ptr + token * stride_qt + heads[:, None] * stride_qh + c[None, :],
        mask=h_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + token * stride_rt + heads[:, None] * stride_rh + r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    table = block_tables_ptr + seq * stride_bt
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        latent = load_paged_tile(cache_ptr, table, pos, valid, 0, stride_cb, stride_cs, c, c_ok, BLOCK_SIZE)  # [N, C]
        k_rope = load_paged_tile(
            cache_ptr, table, pos, valid, LATENT, stride_cb, stride_cs, r, r_ok, BLOCK_SIZE
        )  # [N, R]
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m, den, acc = softmax_tile(m, den, acc, scores, latent, DOT_PRECISION)
    acc_ptrs = part_acc_ptr + row * stride_ar + heads[:, None] * stride_ah + split * stride_as + c[None, :]
    tl.store(acc_ptrs, acc, mask=h_ok[:, None] & c_ok[None, :])
    ml_ptrs = part_ml_ptr + row * stride_mr + heads * stride_mh + split * stride_ms
    tl.store(ml_ptrs, m, mask=h_ok)
    tl.store(ml_ptrs + 1, den, mask=h_ok)


def mla_attention_torch(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    kv_b: Callable[[torch.Tensor], torch.Tensor],
    v_dim: int,
) -> torch.Tensor:
    """The layer's math: expand cached latents with kv_b ([n, C] -> [n, H * (nope + v)]) and attend.

    q_nope [T, H, nope], q_rot [T, H, R] (rotated), latent_cache [blocks, bs, C + R] -> [T, H, v].
    """
    tokens, heads, nope = q_nope.shape
    rope = q_rot.shape[2]
    latent_dim = latent_cache.shape[2] - rope
    q = torch.cat([q_nope, q_rot], dim=-1)  # [T, H, nope + R]
    out = q.new_empty(tokens, heads, v_dim)
    for (start, end), length, table in zip(sequence_spans(query_lens), context_lens, block_tables):
        if end == start:
            continue
        kv_nope, k_rot = gather_cache(latent_cache, table, length).split([latent_dim, rope], dim=-1)
        kv = kv_b(kv_nope).view(length, heads, nope + v_dim)
        k_nope, values = kv.split([nope, v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rot[:, None, :].expand(-1, heads, -1)], dim=-1)  # rope key shared by heads
        out[start:end] = causal_attention(q[start:end], keys, values, scale)
    return out


def check_mla(q_lat: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor, out: torch.Tensor) -> None:
    check_rank("q_lat", q_lat, 3, "[tokens, heads, kv_lora_rank]")
    check_rank("q_rope", q_rope, 3, "[tokens, heads, rope_dim]")
    check_rank("latent_cache", latent_cache, 3, "[blocks, block_size, kv_lora_rank + rope_dim]")
    check_rank("out", out, 3, "[tokens, heads, kv_lora_rank]")
    check_dtype("q_lat", q_lat, FLOAT_DTYPES)
    check_same_dtype("q_lat, q_rope, latent_cache and out", q_lat, q_rope, latent_cache, out)
    check_dim("latent_cache", latent_cache, 2, q_lat.shape[2] + q_rope.shape[2], "latent + rope features")
    check_dim("q_rope", q_rope, 0, q_lat.shape[0], "tokens")
    check_dim("q_rope", q_rope, 1, q_lat.shape[1], "heads")
    check_dim("out", out, 0, q_lat.shape[0], "tokens")
    check_dim("out", out, 1, q_lat.shape[1], "heads")
    check_dim("out", out, 2, q_lat.shape[2], "latent features")
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("latent_cache", latent_cache), ("out", out)):
        check_last_contiguous(name, t)
    check_device(("q_lat", q_lat), ("q_rope", q_rope), ("latent_cache", latent_cache), ("out", out))


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    out: torch.Tensor,
    kv_split: int = KV_SPLIT,
    block_n: int = BLOCK_N,
) -> None:
    """Latent attention for every row of meta: out[token] [H, C] = sum_t softmax_t(score) c_t."""
    check_mla(q_lat, q_rope, latent_cache, out)
    check_meta(meta, q_lat)
    check_tiling(kv_split, block_n)
    if meta.num_rows == 0:
        return
    heads, latent_dim = q_lat.shape[1], q_lat.shape[2]
    splits = cdiv(meta.max_row_len, kv_split)
    part_acc, part_ml = split_buffers(meta.num_rows, heads, splits, latent_dim, q_lat.device)
    _mla_decode_kernel[(meta.num_rows, cdiv(heads, BLOCK_H), splits)](
        q_lat,
        q_rope,
        latent_cache,
        meta.block_tables,
        meta.row_token,
        meta.row_seq,
        meta.row_len,
        part_acc,
        part_ml,
        scale * 1.4426950408889634,
        heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        meta.block_tables.stride(0),
        *part_acc.stride()[:3],
        *part_ml.stride()[:3],
        LATENT=latent_dim,
        ROPE=q_rope.shape[2],
        BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_H=BLOCK_H,
        BLOCK_C=max(16, next_pow2(latent_dim)),
        BLOCK_R=max(16, next_pow2(q_rope.shape[2])),
        BLOCK_N=block_n,
        KV_SPLIT=kv_split,
        DOT_PRECISION=dot_precision(q_lat.dtype),
    )
    merge_splits(part_acc, part_ml, meta.row_token, meta.row_len, out, kv_split)


def absorbed_weights(kv_b_weight: torch.Tensor, heads: int, nope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (nope + v), C] -> W_UK [H, nope, C], W_UV [H, v, C] (views)."""
    w = kv_b_weight.view(heads, nope + v_dim, kv_b_weight.shape[1])
    return w[:, :nope], w[:, nope:]


def mla_attention_triton(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    kv_b_weight: torch.Tensor,
    v_dim: int,
    kv_split: int = KV_SPLIT,
    block_n: int | None = None,
    out_lat: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same inputs and result as mla_attention_torch (meta must hold every token as a row): [T, H, v].

    out_lat: optional buffer [T, H, C] for the latent attention output (the tests poison it)."""
    tokens, heads, nope = q_nope.shape
    if kv_b_weight.shape[0] != heads * (nope + v_dim):
        raise ValueError(
            f"kv_b weight of shape {tuple(kv_b_weight.shape)} does not hold {heads} heads of {nope}+{v_dim}"
        )
    if meta.num_rows != tokens:
        raise ValueError(f"MLA runs every token as a row: meta has {meta.num_rows} rows for {tokens} tokens")
    w_uk, w_uv = absorbed_weights(kv_b_weight.to(q_nope.dtype), heads, nope, v_dim)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C]
    out_lat = output_buffer(
        out_lat, "out_lat", (tokens, heads, w_uk.shape[2]), q_nope.dtype, q_nope.device
    )  # [T, H, C]
    if block_n is None:  # a [64, 512] float32 latent tile would overflow an A100's shared memory
        block_n = BLOCK_N if q_nope.element_size() <= 2 else BLOCK_N // 2
    mla_decode_attention(q_lat, q_rot, latent_cache, meta, scale, out_lat, kv_split, block_n)
    return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]


def default_kv_b(kv_b_weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda latent: F.linear(latent, kv_b_weight)
