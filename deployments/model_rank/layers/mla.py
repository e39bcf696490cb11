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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAAttention(nn.Module):
    def __init__(self, dims: MLADims, rotary: RotaryEmbedding, scale: float, parallel: ParallelContext) -> None:
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
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, q_out, parallel)
        latent = dims.kv_lora_rank + dims.qk_rope_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(dims.hidden_size, latent, bias=dims.attention_bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LORA_NORM_EPS)
        kv_b_out = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, kv_b_out, parallel)
        o_in = dims.num_heads * dims.v_head_dim
        self.o_proj = RowParallelLinear(o_in, dims.hidden_size, parallel, bias=dims.attention_bias)
        self.spec = LayerCacheSpec(kind="latent", latent_dim=latent)
        self.cache: torch.Tensor | None = None

    def cache_spec(self) -> LayerCacheSpec:
        return self.spec

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        (latent,) = cache
        if latent.shape[2:] != (self.spec.latent_dim,):
            raise ValueError(f"latent cache of shape {tuple(latent.shape)} does not match {self.spec}")
        self.cache = latent

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dims.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.local_heads, self.dims.qk_head_dim)  # [T, Hl, nope + rope]

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("KV caches are not bound: call bind_kv_caches() before forward()")
        d = self.dims
        q_nope, q_rot = self._queries(hidden).split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(hidden).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = self.rotary(batch.positions, q_rot, k_rot[:, None, :])  # [T, Hl, rope], [T, 1, rope]
        latents = torch.cat([self.kv_a_layernorm(kv_nope), k_rot[:, 0]], dim=-1)  # [T, kv_lora + rope]
        dispatch.write_cache(self.cache, latents, batch.slot_mapping)
        out = dispatch.mla_attention(
            q_nope, q_rot, self.cache, batch, self.scale, self.kv_b_proj.weight, d.v_head_dim, kv_b=self.kv_b_proj
        )  # [T, Hl, v]
        return self.o_proj(out.reshape(hidden.shape[0], self.local_heads * d.v_head_dim))  # [T, H]
