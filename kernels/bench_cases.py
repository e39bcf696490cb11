"""Benchmark cases for gpu_check: each kernel at a production-like shape beside its torch baselines.

A case holds closures ready to time, the least HBM traffic and FLOPs the work needs (for the roofline),
and the Triton and torch-path outputs for a sanity check. `tiny` shrinks every shape so the cases can be
dry-run on CPU under the interpreter.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import fused_moe, kv_write, matmul, mla_decode, moe_routing, recurrent_scan, rmsnorm, rotary
from kernels.attention_torch import paged_attention_torch
from kernels.causal_conv_scan import causal_conv_scan
from kernels.gated_delta_scan import gated_delta_scan
from kernels.mamba2_scan import mamba2_scan
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_meta import build_paged_meta
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.recurrent_scan import ScanRows
from kernels.scan_meta import build_scan_meta


@dataclass
class Case:
    name: str
    shape: str
    triton: Callable[[], object]
    baselines: dict[str, Callable[[], object]] = field(default_factory=dict)  # "torch", "sdpa"
    bytes: int = 0
    flops: int = 0


def _rand(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=device).mul_(scale).to(dtype)


def _paged(batch: int, ctx: int, block_size: int, row: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Shuffled block tables and a full random cache [blocks, block_size, *row]."""
    per_seq = -(-ctx // block_size)
    tables = torch.randperm(batch * per_seq).view(batch, per_seq).tolist()
    return tables, _rand(batch * per_seq, block_size, *row, dtype=dtype, device=device)


def decode_attention(device: torch.device, tiny: bool) -> Case:
    batch, ctx, hq, hkv, dim, bs = (2, 40, 4, 2, 64, 16) if tiny else (32, 2048, 32, 8, 128, 16)
    dtype, scale = torch.bfloat16, dim**-0.5
    tables, k_cache = _paged(batch, ctx, bs, (hkv, dim), dtype, device)
    v_cache = torch.randn_like(k_cache)
    q = _rand(batch, hq, dim, dtype=dtype, device=device)
    meta = build_paged_meta([1] * batch, [ctx] * batch, tables, bs, device)
    out = torch.empty_like(q)
    k_dense, v_dense = (_rand(batch, hkv, ctx, dim, dtype=dtype, device=device) for _ in range(2))
    return Case(
        "paged decode attention",
        f"B={batch} ctx={ctx} H={hq}/{hkv} D={dim}",
        lambda: paged_decode_attention(q, k_cache, v_cache, meta, scale, out) or out,
        {
            "torch": lambda: paged_attention_torch(q, k_cache, v_cache, [1] * batch, [ctx] * batch, tables, scale),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q[:, :, None], k_dense, v_dense, scale=scale, enable_gqa=True
            ),
        },
        bytes=2 * batch * ctx * hkv * dim * 2 + 2 * q.numel() * 2,
        flops=4 * batch * hq * ctx * dim,
    )


def _lower_right_mask(new: int, ctx: int, device: torch.device) -> object:
    try:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(new, ctx)
    except ImportError:
        return torch.ones(new, ctx, dtype=torch.bool, device=device).tril(ctx - new)


def prefill_attention(device: torch.device, tiny: bool) -> Case:
    batch, cached, new, hq, hkv, dim, bs = (2, 20, 24, 4, 2, 64, 16) if tiny else (4, 1024, 1024, 32, 8, 128, 16)
    ctx, dtype, scale = cached + new, torch.bfloat16, dim**-0.5
    tables, k_cache = _paged(batch, ctx, bs, (hkv, dim), dtype, device)
    v_cache = torch.randn_like(k_cache)
    q = _rand(batch * new, hq, dim, dtype=dtype, device=device)
    meta = build_paged_meta([new] * batch, [ctx] * batch, tables, bs, device)
    out = torch.empty_like(q)
    q_dense = q.view(batch, new, hq, dim).transpose(1, 2)
    k_dense, v_dense = (_rand(batch, hkv, ctx, dim, dtype=dtype, device=device) for _ in range(2))
    mask = _lower_right_mask(new, ctx, device)
    return Case(
        "paged prefill attention",
        f"B={batch} cached={cached} new={new} H={hq}/{hkv} D={dim}",
        lambda: paged_prefill_attention(q, k_cache, v_cache, meta, scale, out) or out,
        {
            "torch": lambda: paged_attention_torch(q, k_cache, v_cache, [new] * batch, [ctx] * batch, tables, scale),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q_dense, k_dense, v_dense, attn_mask=mask, scale=scale, enable_gqa=True
            ),
        },
        bytes=2 * batch * ctx * hkv * dim * 2 + 2 * q.numel() * 2,
        flops=4 * batch * hq * dim * (new * cached + new * (new + 1) // 2),
    )


def mla_decode_attention(device: torch.device, tiny: bool) -> Case:
    batch, ctx, heads, latent, rope, nope, v_dim, bs = (
        (2, 40, 4, 64, 16, 32, 32, 16) if tiny else (32, 2048, 20, 512, 64, 192, 256, 16)
    )
    dtype, scale = torch.bfloat16, (nope + rope) ** -0.5
    tables, cache = _paged(batch, ctx, bs, (latent + rope,), dtype, device)
    q_nope, q_rot = (
        _rand(batch, heads, nope, dtype=dtype, device=device),
        _rand(batch, heads, rope, dtype=dtype, device=device),
    )
    w = _rand(heads * (nope + v_dim), latent, dtype=dtype, device=device, scale=latent**-0.5)
    meta = build_paged_meta([1] * batch, [ctx] * batch, tables, bs, device, row_query_limit=2**31 - 1)
    expand = mla_decode.default_kv_b(w)
    return Case(
        "MLA decode (absorbed)",
        f"B={batch} ctx={ctx} H={heads} C={latent}+{rope}",
        lambda: mla_decode.mla_attention_triton(q_nope, q_rot, cache, meta, scale, w, v_dim),
        {
            "torch": lambda: mla_decode.mla_attention_torch(
                q_nope, q_rot, cache, [1] * batch, [ctx] * batch, tables, scale, expand, v_dim
            )
        },
        bytes=batch * ctx * (latent + rope) * 2 + w.numel() * 2,
        flops=4 * batch * heads * ctx * (latent + rope) + 4 * batch * heads * latent * (nope + v_dim),
    )


def add_rms_norm(device: torch.device, tiny: bool) -> Case:
    tokens, hidden = (4, 96) if tiny else (4096, 5120)
    x, res = (_rand(tokens, hidden, dtype=torch.bfloat16, device=device) for _ in range(2))
    w = _rand(hidden, dtype=torch.bfloat16, device=device)
    return Case(
        "add + RMSNorm",
        f"T={tokens} H={hidden}",
        lambda: rmsnorm.add_rms_norm(x, res, w, 1e-5)[0],
        {"torch": lambda: rmsnorm.add_rms_norm_torch(x, res, w, 1e-5)[0]},
        bytes=4 * tokens * hidden * 2,
    )


def rotary_embedding(device: torch.device, tiny: bool) -> Case:
    tokens, hq, hk, dim = (4, 4, 2, 64) if tiny else (4096, 32, 8, 128)
    q, k = (
        _rand(tokens, hq, dim, dtype=torch.bfloat16, device=device),
        _rand(tokens, hk, dim, dtype=torch.bfloat16, device=device),
    )
    positions = torch.arange(tokens, device=device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, dim // 2, 2, dtype=torch.float32) / (dim // 2))).to(device)
    return Case(
        "rotary (GLM partial 0.5)",
        f"T={tokens} H={hq}/{hk} D={dim}",
        lambda: rotary.rotary(positions, q, k, inv_freq, 1.0, False)[0],
        {"torch": lambda: rotary.rotary_torch(positions, q, k, inv_freq, 1.0, False)[0]},
        bytes=2 * (q.numel() + k.numel()) * 2,
    )


def cache_write(device: torch.device, tiny: bool) -> Case:
    tokens, heads, dim, blocks, bs = (4, 2, 64, 4, 16) if tiny else (4096, 8, 128, 8192, 16)
    cache = _rand(blocks, bs, heads, dim, dtype=torch.bfloat16, device=device)
    values = _rand(tokens, heads, dim, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(blocks * bs, device=device)[:tokens]
    return Case(
        "KV cache write",
        f"T={tokens} H={heads} D={dim}",
        lambda: kv_write.write_cache(cache, values, slots),
        {"torch": lambda: kv_write.write_cache_torch(cache, values, slots)},
        bytes=2 * values.numel() * 2,
    )


def moe_routing_case(device: torch.device, tiny: bool) -> Case:
    tokens, experts, top_k = (4, 32, 4) if tiny else (4096, 160, 8)
    logits, bias = torch.randn(tokens, experts, device=device), torch.randn(experts, device=device) * 0.1
    args = (logits, bias, top_k, 1, 1, True, 2.5)
    return Case(
        "GLM sigmoid routing",
        f"T={tokens} E={experts} k={top_k}",
        lambda: moe_routing.grouped_topk(*args)[0],
        {"torch": lambda: moe_routing.grouped_topk_torch(*args)[0]},
        bytes=logits.numel() * 4,
    )


def fused_experts(device: torch.device, tiny: bool, tokens: int) -> Case:
    experts, top_k, hidden, inter = (8, 2, 64, 96) if tiny else (64, 4, 2048, 1536)
    tokens = 3 if tiny else tokens
    x = _rand(tokens, hidden, dtype=torch.bfloat16, device=device)
    gate, up = (
        _rand(experts, inter, hidden, dtype=torch.bfloat16, device=device, scale=hidden**-0.5) for _ in range(2)
    )
    down = _rand(experts, hidden, inter, dtype=torch.bfloat16, device=device, scale=inter**-0.5)
    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device)
    touched = int(torch.unique(ids).numel())
    return Case(
        "fused MoE experts",
        f"T={tokens} E={experts} k={top_k} H={hidden} I={inter}",
        lambda: fused_moe.fused_moe(x, weights, ids, gate, up, down),
        {"torch": lambda: fused_moe.fused_moe_torch(x, weights, ids, gate, up, down)},
        bytes=touched * 3 * hidden * inter * 2 + 2 * x.numel() * 2,
        flops=6 * tokens * top_k * hidden * inter,
    )


def _scan_rows(batch: int, rows: int) -> ScanRows:
    """`batch` sequences of `rows` rows each, sequence i in slot i."""
    starts = tuple(i * rows for i in range(batch))
    return ScanRows(starts, tuple(s + rows for s in starts), tuple(range(batch)))


def _fresh(pool: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`run` on a copy of the pool's starting states each call, so every timed run (and the sanity check)
    computes the same step: the copy is timed too, on both paths, and counted in the case's bytes."""
    work = pool.clone()
    return lambda: run(work.copy_(pool))


def conv_scan(device: torch.device, tiny: bool) -> Case:
    batch, rows, channels = (2, 5, 40) if tiny else (4, 512, 8192)
    x = _rand(batch * rows, channels, dtype=torch.bfloat16, device=device)
    pool = _rand(batch, 3, channels, dtype=torch.bfloat16, device=device)
    weight = _rand(channels, 4, dtype=torch.bfloat16, device=device)
    scan = _scan_rows(batch, rows)
    meta = build_scan_meta(scan, batch * rows, device)
    return Case(
        "causal conv scan",
        f"B={batch} rows={rows} C={channels} K=4",
        _fresh(pool, lambda p: causal_conv_scan(x, p, weight, None, meta)),
        {"torch": _fresh(pool, lambda p: recurrent_scan.causal_conv_scan(x, p, weight, None, scan))},
        bytes=x.numel() * 2 + x.numel() * 4 + 4 * pool.numel() * 2,
    )


def delta_scan(device: torch.device, tiny: bool, rows: int) -> Case:
    """Qwen3-Next's Gated DeltaNet: 32 value heads of 128 over 16 key heads."""
    batch, heads, dim = (2, 4, 16) if tiny else (64 if rows == 1 else 4, 32, 128)
    rows = min(rows, 5) if tiny else rows
    tokens = batch * rows
    q, k = (F.normalize(_rand(tokens, heads, dim, dtype=torch.float32, device=device), dim=-1) for _ in range(2))
    v = _rand(tokens, heads, dim, dtype=torch.float32, device=device)
    a = _rand(tokens, heads, dtype=torch.bfloat16, device=device)
    beta = torch.rand(tokens, heads, device=device)
    neg_a, dt_bias = -torch.rand(heads, device=device), _rand(heads, dtype=torch.bfloat16, device=device)
    pool = _rand(batch, heads, dim, dim, dtype=torch.float32, device=device, scale=0.1)
    scan = _scan_rows(batch, rows)
    meta = build_scan_meta(scan, tokens, device)
    args = (q, k, v, a, beta, neg_a, dt_bias)
    return Case(
        "gated delta scan",
        f"B={batch} rows={rows} Hv={heads} Dk=Dv={dim}",
        _fresh(pool, lambda p: gated_delta_scan(p, *args, meta)),
        {"torch": _fresh(pool, lambda p: recurrent_scan.gated_delta_scan(p, *args, scan))},
        bytes=4 * pool.numel() * 4 + 4 * (q.numel() + k.numel() + 2 * v.numel()),
        flops=6 * tokens * heads * dim * dim,
    )


def mamba2_state_scan(device: torch.device, tiny: bool, rows: int) -> Case:
    """Nemotron-H's Mamba2: 128 heads of 64, state 128, 8 groups."""
    batch, heads, head_dim, state = (2, 4, 8, 16) if tiny else (64 if rows == 1 else 4, 128, 64, 128)
    rows = min(rows, 5) if tiny else rows
    tokens = batch * rows
    x = _rand(tokens, heads, head_dim, dtype=torch.float32, device=device)
    b, c = (_rand(tokens, heads, state, dtype=torch.float32, device=device) for _ in range(2))
    dt, dt_bias = (
        _rand(tokens, heads, dtype=torch.bfloat16, device=device),
        _rand(heads, dtype=torch.bfloat16, device=device),
    )
    a, d = -torch.rand(heads, device=device), torch.rand(heads, device=device)
    pool = _rand(batch, heads, head_dim, state, dtype=torch.float32, device=device, scale=0.1)
    scan = _scan_rows(batch, rows)
    meta = build_scan_meta(scan, tokens, device)
    args = (x, b, c, dt, dt_bias, a, d, (0.0, float("inf")))
    return Case(
        "Mamba2 state scan",
        f"B={batch} rows={rows} H={heads} P={head_dim} N={state}",
        _fresh(pool, lambda p: mamba2_scan(p, *args, meta)),
        {"torch": _fresh(pool, lambda p: recurrent_scan.mamba2_scan(p, *args, scan))},
        bytes=4 * pool.numel() * 4 + 4 * (2 * x.numel() + b.numel() + c.numel()),
        flops=6 * tokens * heads * head_dim * state,
    )


def projection(device: torch.device, tiny: bool, rows: int) -> Case:
    """The invariant matmul against cuBLAS on Qwen3-1.7B's gate/up projection (hidden 2048 -> 6144)."""
    cols, depth = (80, 96) if tiny else (6144, 2048)
    x = _rand(rows, depth, dtype=torch.bfloat16, device=device)
    weight = _rand(cols, depth, dtype=torch.bfloat16, device=device, scale=depth**-0.5)
    return Case(
        "invariant matmul",
        f"M={rows} N={cols} K={depth}",
        lambda: matmul.invariant_matmul(x, weight),
        {"torch": lambda: F.linear(x, weight)},
        bytes=2 * (rows * depth + cols * depth + rows * cols),
        flops=2 * rows * cols * depth,
    )


def all_cases(device: torch.device, tiny: bool) -> list[Callable[[], Case]]:
    """Builders, so each case's tensors are freed before the next is built."""
    return [
        lambda: projection(device, tiny, rows=1),
        lambda: projection(device, tiny, rows=16),
        lambda: projection(device, tiny, rows=512),
        lambda: decode_attention(device, tiny),
        lambda: prefill_attention(device, tiny),
        lambda: mla_decode_attention(device, tiny),
        lambda: add_rms_norm(device, tiny),
        lambda: rotary_embedding(device, tiny),
        lambda: cache_write(device, tiny),
        lambda: moe_routing_case(device, tiny),
        lambda: fused_experts(device, tiny, tokens=16),
        lambda: fused_experts(device, tiny, tokens=512),
        lambda: conv_scan(device, tiny),
        lambda: delta_scan(device, tiny, rows=1),
        lambda: delta_scan(device, tiny, rows=256),
        lambda: mamba2_state_scan(device, tiny, rows=1),
        lambda: mamba2_state_scan(device, tiny, rows=256),
    ]
