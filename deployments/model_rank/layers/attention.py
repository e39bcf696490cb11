"""Paged attention (the torch path) and the grouped-query self-attention block built on it.

Batch invariance: each sequence attends on its own; float32 models score in float64 (so a row's result
does not move with how many rows or masked keys share the call), bf16/fp16 models run QK^T and PV in their
own dtype with a float32 softmax, which was measured invariant to query chunking.
"""

import math

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, RowParallelLinear
from deployments.model_rank.layers.norm import RMSNorm
from deployments.model_rank.layers.parallel import divide
from deployments.model_rank.layers.rotary import RotaryEmbedding


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' rows (values [T, ...]) at their slots of cache [blocks, block_size, ...]."""
    flat = cache.view(-1, *cache.shape[2:])  # [blocks * block_size, ...]
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def gather_cache(cache: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence, in order: [length, ...]."""
    block_size = cache.shape[1]
    num_blocks = math.ceil(length / block_size)
    if num_blocks > len(block_table):
        raise ValueError(f"context of {length} tokens needs {num_blocks} blocks, block table has {len(block_table)}")
    index = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=cache.device)
    rows = cache.index_select(0, index)  # [n, block_size, ...]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one sequence's new queries over its whole context.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> [Tq, Hq, Dv]; query j sits at position Tk - Tq + j.
    """
    num_q, num_heads = q.shape[0], q.shape[1]
    num_k, group = k.shape[0], num_heads // k.shape[1]
    compute = torch.float64 if q.dtype == torch.float32 else q.dtype
    qh = q.to(compute).transpose(0, 1)  # [Hq, Tq, D]
    kh = k.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vh = v.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, Dv]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
    future = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).triu(num_k - num_q + 1)  # [Tq, Tk]
    scores = scores.masked_fill(future, float("-inf"))
    softmax_dtype = torch.float64 if compute == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(compute)  # [Hq, Tq, Tk]
    out = torch.matmul(probs, vh)  # [Hq, Tq, Dv]
    return out.transpose(0, 1).to(q.dtype)


def sequence_spans(batch: ForwardBatch) -> list[tuple[int, int]]:
    """(start, end) of each sequence's new tokens in the flat token dimension."""
    spans, start = [], 0
    for n in batch.query_lens:
        spans.append((start, start + n))
        start += n
    return spans


class PagedAttention(nn.Module):
    """Writes new K/V into this layer's paged cache and attends each sequence over its cached context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, v_head_dim: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.spec = LayerCacheSpec(kind="kv", num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)
        self.scale = scale
        self.cache: tuple[torch.Tensor, ...] | None = None

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        k_cache, v_cache = cache
        if k_cache.shape[2:] != (self.spec.num_kv_heads, self.spec.head_dim):
            raise ValueError(f"K cache of shape {tuple(k_cache.shape)} does not match {self.spec}")
        if v_cache.shape[2:] != (self.spec.num_kv_heads, self.spec.v_head_dim or self.spec.head_dim):
            raise ValueError(f"V cache of shape {tuple(v_cache.shape)} does not match {self.spec}")
        self.cache = (k_cache, v_cache)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv]."""
        if self.cache is None:
            raise RuntimeError("KV caches are not bound: call bind_kv_caches() before forward()")
        k_cache, v_cache = self.cache
        write_cache(k_cache, k, batch.slot_mapping)
        write_cache(v_cache, v, batch.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])  # [T, Hq, Dv]
        for (start, end), length, table in zip(sequence_spans(batch), batch.context_lens, batch.block_tables):
            if end == start:
                continue
            keys = gather_cache(k_cache, table, length)  # [ctx, Hkv, D]
            values = gather_cache(v_cache, table, length)  # [ctx, Hkv, Dv]
            out[start:end] = causal_attention(q[start:end], keys, values, self.scale)
        return out


def kv_head_sharding(num_kv_heads: int, parallel: ParallelContext) -> tuple[int, int, int]:
    """(kv heads per rank, shard index, number of shards); kv heads are replicated when fewer than ranks."""
    if num_kv_heads >= parallel.tp_size:
        return divide(num_kv_heads, parallel.tp_size, "kv heads"), parallel.tp_rank, parallel.tp_size
    divide(parallel.tp_size, num_kv_heads, "tensor-parallel size over kv heads")
    return 1, parallel.tp_rank * num_kv_heads // parallel.tp_size, num_kv_heads


class SelfAttention(nn.Module):
    """GQA self-attention: q/k/v projections (column-parallel by heads), optional per-head QK-norm
    before RoPE (Qwen3, GLM `use_qk_norm`), paged attention, o_proj (row-parallel)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        parallel: ParallelContext,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.local_heads = divide(num_heads, parallel.tp_size, "attention heads")
        self.local_kv_heads, kv_index, kv_shards = kv_head_sharding(num_kv_heads, parallel)
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, parallel, bias=qkv_bias)
        kv_out = num_kv_heads * head_dim
        self.k_proj = ColumnParallelLinear(hidden_size, kv_out, parallel, qkv_bias, kv_index, kv_shards)
        self.v_proj = ColumnParallelLinear(hidden_size, kv_out, parallel, qkv_bias, kv_index, kv_shards)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, parallel, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary = rotary
        self.attn = PagedAttention(self.local_heads, self.local_kv_heads, head_dim, head_dim**-0.5)

    def cache_spec(self) -> LayerCacheSpec:
        return self.attn.spec

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.attn.bind_cache(cache)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.local_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(hidden).view(tokens, self.local_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(hidden).view(tokens, self.local_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(batch.positions, q, k)
        out = self.attn(q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, self.local_heads * self.head_dim))  # [T, H]
