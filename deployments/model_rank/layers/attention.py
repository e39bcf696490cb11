"""Paged attention and the grouped-query self-attention block built on it.

The attention itself runs through `kernels.dispatch`: Triton kernels on CUDA, the batch-invariant torch
path (kernels/attention_torch.py: each sequence on its own, scored in float64 on CPU) elsewhere.
"""

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, FusedProjection, RowParallelLinear
from deployments.model_rank.layers.norm import RMSNorm, ZeroCentredRMSNorm
from deployments.model_rank.layers.parallel import divide
from deployments.model_rank.layers.rotary import RotaryEmbedding
from kernels import dispatch
from kernels.activation import sigmoid


class PagedAttention(nn.Module):
    """Writes new K/V into this layer's paged cache and attends each sequence over its cached context."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, v_head_dim: int = 0, window: int = 0
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.spec = LayerCacheSpec(kind="kv", num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)
        self.scale = scale
        self.window = window  # > 0: a sliding-window layer, each query sees its last `window` positions
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
        dispatch.write_cache(k_cache, k, batch.slot_mapping)
        dispatch.write_cache(v_cache, v, batch.slot_mapping)
        return self.attend(q, batch)

    def attend(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D] over the cache as it stands (a layer sharing this one's K/V reads it so, no copy)."""
        if self.cache is None:
            raise RuntimeError("KV caches are not bound: call bind_kv_caches() before forward()")
        k_cache, v_cache = self.cache
        return dispatch.paged_attention(q, k_cache, v_cache, batch, self.scale, self.window)  # [T, Hq, Dv]


def kv_head_sharding(num_kv_heads: int, parallel: ParallelContext) -> tuple[int, int, int]:
    """(kv heads per rank, shard index, number of shards); kv heads are replicated when fewer than ranks."""
    if num_kv_heads >= parallel.tp_size:
        return divide(num_kv_heads, parallel.tp_size, "kv heads"), parallel.tp_rank, parallel.tp_size
    divide(parallel.tp_size, num_kv_heads, "tensor-parallel size over kv heads")
    return 1, parallel.tp_rank * num_kv_heads // parallel.tp_size, num_kv_heads


class SelfAttention(nn.Module):
    """GQA self-attention: q/k/v projections (column-parallel by heads), optional per-head QK-norm
    before RoPE (Qwen3, GLM `use_qk_norm`), paged attention, o_proj (row-parallel). `rotary` None: no
    position encoding at all (Nemotron-H's attention blocks)."""

    query_width = 1  # q_proj features per query feature (2: each head's query is followed by its output gate)
    qk_norm_type: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None,
        parallel: ParallelContext,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.local_heads = divide(num_heads, parallel.tp_size, "attention heads")
        self.local_kv_heads, kv_index, kv_shards = kv_head_sharding(num_kv_heads, parallel)
        self.q_proj = ColumnParallelLinear(hidden_size, self.query_width * num_heads * head_dim, parallel, qkv_bias)
        kv_out = num_kv_heads * head_dim
        self.k_proj = ColumnParallelLinear(hidden_size, kv_out, parallel, qkv_bias, kv_index, kv_shards)
        self.v_proj = ColumnParallelLinear(hidden_size, kv_out, parallel, qkv_bias, kv_index, kv_shards)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, parallel, bias=o_bias)
        self.q_norm = self.qk_norm_type(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = self.qk_norm_type(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary = rotary
        self.attn = PagedAttention(self.local_heads, self.local_kv_heads, head_dim, head_dim**-0.5)
        self.qkv: FusedProjection | None = None  # set after packing (layers/packing.py)

    def fuse_projections(self) -> bool:
        """One GEMM call for q, k and v where their packed weights allow it."""
        siblings = [self.q_proj, self.k_proj, self.v_proj]
        if FusedProjection.fits(siblings):
            self.qkv = FusedProjection(siblings)
        return self.qkv is not None

    def cache_spec(self) -> LayerCacheSpec:
        return self.attn.spec

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.attn.bind_cache(cache)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [T, features of this rank]."""
        if self.qkv is not None:  # q and k contiguous for the norm and RoPE kernels; v only goes to the cache
            q, k, v = self.qkv(hidden)
            return q.contiguous(), k.contiguous(), v
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.project(hidden)
        q = q.view(tokens, self.local_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(tokens, self.local_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(tokens, self.local_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        out = self.attn(q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, self.local_heads * self.head_dim))  # [T, H]


class GatedSelfAttention(SelfAttention):
    """Qwen3-Next / Qwen3.5 full attention: q_proj gives each head its query followed by an output gate of
    the same width (whole heads' rows stay together when it is split across ranks), and the attention output
    is scaled by sigmoid(gate) before o_proj; the QK-norm (pass `qk_norm_eps`) is zero-centred."""

    query_width = 2
    qk_norm_type = ZeroCentredRMSNorm

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens, width = hidden.shape[0], self.local_heads * self.head_dim
        query_gate, k, v = self.project(hidden)
        query_gate = query_gate.view(tokens, self.local_heads, 2 * self.head_dim)  # [T, Hq, 2D]
        q = query_gate[..., : self.head_dim]  # [T, Hq, D]
        k = k.view(tokens, self.local_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(batch.positions, q.contiguous(), k, batch.mrope_positions)
        out = self.attn(q, k, v.view(tokens, self.local_kv_heads, self.head_dim), batch)  # [T, Hq, D]
        gate = sigmoid(query_gate[..., self.head_dim :].reshape(tokens, width))
        return self.o_proj(out.reshape(tokens, width) * gate)  # [T, H]
