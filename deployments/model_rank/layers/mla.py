"""Multi-head latent attention (DeepSeek-V3 / GLM-4.7-Flash) over a paged cache of compressed latents.

The cache holds one row per token: the normalised KV latent (kv_lora_rank) followed by the rotated shared
rope key (qk_rope_head_dim). Each step expands a sequence's latents to per-head K/V with kv_b_proj, so the
math matches the reference model; heads are sharded across ranks, the latent is replicated.
"""

from dataclasses import dataclass

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from deployments.model_rank.layers.norm import RMSNorm
from deployments.model_rank.layers.parallel import divide
from deployments.model_rank.layers.rotary import RotaryEmbedding
from kernels import dispatch

LORA_NORM_EPS = 1e-6  # the reference model builds its q/kv latent norms with the default epsilon


@dataclass(frozen=True)
class MLADims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: q is projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False
    lora_eps: float = LORA_NORM_EPS  # the q and kv latents' RMSNorms

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAAttention(nn.Module):
    """`rotary` None: a NoPE model (qk_rope_head_dim 0, GLM-5.3-Flash's) whose keys carry no position."""

    def __init__(
        self, dims: MLADims, rotary: RotaryEmbedding | None, scale: float, parallel: ParallelContext, index_dim: int = 0
    ) -> None:
        super().__init__()
        self.dims = dims
        self.scale = scale
        self.rotary = rotary
        self.local_heads = divide(dims.num_heads, parallel.tp_size, "attention heads")
        q_out = dims.num_heads * dims.qk_head_dim
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(dims.hidden_size, q_out, parallel)
        else:
            self.q_a_proj = ReplicatedLinear(dims.hidden_size, dims.q_lora_rank, bias=dims.attention_bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, dims.lora_eps)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, q_out, parallel)
        latent = dims.kv_lora_rank + dims.qk_rope_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(dims.hidden_size, latent, bias=dims.attention_bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, dims.lora_eps)
        kv_b_out = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, kv_b_out, parallel)
        o_in = dims.num_heads * dims.v_head_dim
        self.o_proj = RowParallelLinear(o_in, dims.hidden_size, parallel, bias=dims.attention_bias)
        self.latent_width = latent
        # A DSA layer's index keys ride in the same row, after the latent (layers/dsa_attention.py).
        self.spec = LayerCacheSpec(kind="latent", latent_dim=latent + index_dim, index_dim=index_dim)
        self.cache: torch.Tensor | None = None

    def cache_spec(self) -> LayerCacheSpec:
        return self.spec

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        (latent,) = cache
        if latent.shape[2:] != (self.spec.latent_dim,):
            raise ValueError(f"latent cache of shape {tuple(latent.shape)} does not match {self.spec}")
        self.cache = latent

    def q_latent(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The normalised q latent [T, q_lora_rank] (None without one): q's input, and a DSA indexer's."""
        return None if self.dims.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden))

    def queries(self, hidden: torch.Tensor, q_latent: torch.Tensor | None) -> torch.Tensor:
        q = self.q_proj(hidden) if q_latent is None else self.q_b_proj(q_latent)
        return q.view(hidden.shape[0], self.local_heads, self.dims.qk_head_dim)  # [T, Hl, nope + rope]

    def project(
        self, hidden: torch.Tensor, q_latent: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, Hl, nope], q_rot [T, Hl, rope] rotated, the cache rows' latents [T, kv_lora + rope])."""
        d = self.dims
        q_nope, q_rot = self.queries(hidden, q_latent).split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(hidden).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        if self.rotary is not None:
            q_rot, k_rot = self.rotary(batch.positions, q_rot, k_rot[:, None, :])  # [T, Hl, rope], [T, 1, rope]
            k_rot = k_rot[:, 0]
        return q_nope, q_rot, torch.cat([self.kv_a_layernorm(kv_nope), k_rot], dim=-1)

    def attend(self, q_nope: torch.Tensor, q_rot: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention over the written cache rows, projected: [T, H]."""
        d, weight = self.dims, self.kv_b_proj.weight
        out = dispatch.mla_attention(
            q_nope, q_rot, self.bound_cache(), batch, self.scale, weight, d.v_head_dim, kv_b=self.kv_b_proj
        )  # [T, Hl, v]
        return self.project_out(out)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [T, Hl, v] through o_proj: [T, H]."""
        return self.o_proj(out.reshape(out.shape[0], self.local_heads * self.dims.v_head_dim))

    def bound_cache(self) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("KV caches are not bound: call bind_kv_caches() before forward()")
        return self.cache

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_nope, q_rot, latents = self.project(hidden, self.q_latent(hidden), batch)
        dispatch.write_cache(self.bound_cache(), latents, batch.slot_mapping)
        return self.attend(q_nope, q_rot, batch)
