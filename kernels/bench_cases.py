"""Benchmark cases for gpu_check: each kernel at a production-like shape beside its torch baselines.

A case holds closures ready to time, the least HBM traffic and FLOPs the work needs (for the roofline),
and the Triton and torch-path outputs for a sanity check. `tiny` shrinks every shape so the cases can be
dry-run on CPU under the interpreter.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import fused_moe, kv_write, mla_decode, moe_routing, rmsnorm, rotary
from kernels.attention_torch import paged_attention_torch
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_meta import build_paged_meta
from kernels.paged_prefill_attention import paged_prefill_attention


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


def all_cases(device: torch.device, tiny: bool) -> list[Callable[[], Case]]:
    """Builders, so each case's tensors are freed before the next is built."""
    return [
        lambda: decode_attention(device, tiny),
        lambda: prefill_attention(device, tiny),
        lambda: mla_decode_attention(device, tiny),
        lambda: add_rms_norm(device, tiny),
        lambda: rotary_embedding(device, tiny),
        lambda: cache_write(device, tiny),
        lambda: moe_routing_case(device, tiny),
        lambda: fused_experts(device, tiny, tokens=16),
        lambda: fused_experts(device, tiny, tokens=512),
    ]
